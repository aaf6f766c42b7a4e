"""The embedded broker: kombu's filesystem transport with atomic message writes.

kombu's own `_put` creates the message file and then writes it, so a consumer polling the folder can move
and read the file while it is still empty and die on the JSON. Here the message is written to a temporary
name the consumer ignores and renamed into place, which is atomic on one filesystem.
"""
import os
import uuid
from time import monotonic

from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = final + ".partial"  # "<queue>.msg.partial" never matches a queue's "<queue>.msg"
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise filesystem.ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def register() -> None:
    TRANSPORT_ALIASES.setdefault("muninnfs", "muninn.broker:Transport")
