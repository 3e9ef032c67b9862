"""Chat channels: one interface (base.Channel), one module per chat service.

`registry.build_channels` makes the channels the config enables.
"""

from mdclaw.channels.base import (
    Channel,
    ChannelError,
    InboundCallback,
    InboundMessage,
    channel_for,
    split_text,
)

__all__ = ["Channel", "ChannelError", "InboundCallback", "InboundMessage", "channel_for",
           "split_text"]
