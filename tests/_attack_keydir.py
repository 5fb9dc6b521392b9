"""The stranger's side of the key-directory squat: take the name another user's key directory would have.

    python -m tests._attack_keydir BASE VICTIM_UID KIND [TARGET]

KIND: ``dir`` (an open directory of the stranger's), ``file`` (a plain file), ``symlink`` (a link to TARGET,
a directory of the victim's). Also plants ``BASE/weightsync-<uid>.decoy/weightsync-<uid>``, an open directory
of the stranger's shaped like the victim's fallback, hoping the victim picks it. Prints ``planted``.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    base, uid, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    name = os.path.join(base, f"weightsync-{uid}")
    if kind == "dir":
        os.mkdir(name)
        os.chmod(name, 0o777)
    elif kind == "file":
        with open(name, "w") as out:
            out.write("mine\n")
    elif kind == "symlink":
        os.symlink(sys.argv[4], name)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    decoy = os.path.join(base, f"weightsync-{uid}.decoy", f"weightsync-{uid}")
    os.makedirs(decoy)
    os.chmod(decoy, 0o777)
    os.chmod(os.path.dirname(decoy), 0o777)
    print("planted", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
