import sys

from weightsync.app.early import start_forkserver_early

if __name__ == "__main__":
    start_forkserver_early(sys.argv[1:])  # (before the app's imports, which it overlaps)
    from weightsync.app.main import main

    main()
