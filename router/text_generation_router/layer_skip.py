"""The layer-skip modes of this fork's extension, as the CLI, the request parameter
`layer_skip`, the wire (Request.layer_skip_mode, InfoResponse.layer_skip_mode) and the
reports spell them."""

from __future__ import annotations

from enum import StrEnum


class LayerSkipMode(StrEnum):
    """A str: members compare equal to, and format as, their wire spelling."""

    OFF = "off"
    SHADOW = "shadow"
    LOSSY = "lossy"
    VERIFIED = "verified"


LAYER_SKIP_MODES: tuple[str, ...] = tuple(m.value for m in LayerSkipMode)  # in the order messages list them
