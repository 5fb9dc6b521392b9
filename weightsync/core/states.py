"""The states a scheme goes through: new, then sender or receiver, connected, then shut down."""

from __future__ import annotations

__all__ = ["CLOSED", "NEW", "RECEIVER", "RECEIVER_CONNECTED", "SENDER", "SENDER_CONNECTED", "SENDING", "RECEIVING"]

NEW = "new"
SENDER = "initialized as sender"
SENDER_CONNECTED = "connected sender"
RECEIVER = "initialized as receiver"
RECEIVER_CONNECTED = "connected receiver"
CLOSED = "shut down"
#: The states of a scheme playing each role.
SENDING = (SENDER, SENDER_CONNECTED)
RECEIVING = (RECEIVER, RECEIVER_CONNECTED)
