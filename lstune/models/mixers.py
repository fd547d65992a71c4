"""Token mixers that are not attention: what lstune's packing and sequence parallelism cannot see.

lstune keeps packed documents apart and shards the sequence for SP through attention alone (documents from
`position_ids`, all-to-alls around the attention call). A layer that mixes neighbouring tokens some other way — the
short causal convolutions of LFM2, the convolutions in front of Mamba-style state-space layers — reads the tokens
before it directly: across a packed document boundary (in plain transformers too: these layers ignore
`position_ids`), and, under SP, it misses the previous shard's last tokens. Such layers are found structurally (a
convolution module inside a decoder layer) and packing / SP is refused for them; on one long sample they are exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lstune.errors import ModelError

if TYPE_CHECKING:
    from torch import nn


def convolution_mixers(layers: "nn.ModuleList") -> list[str]:
    """Qualified names (`layers.<i>.<path>`) of the convolutions inside the decoder layers."""
    from torch import nn

    found = []
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if isinstance(module, (nn.Conv1d, nn.Conv2d)):
                found.append(f"layers.{index}.{name}")
    return found


def check_token_mixers(layers: "nn.ModuleList", *, pack: bool, sp: int) -> None:
    """ModelError when packed documents or SP shards would leak through a convolutional token mixer
    (`layers`: the decoder layers, `ModelParts.layers`)."""
    convolutions = convolution_mixers(layers)
    if not convolutions or not (pack or sp > 1):
        return
    where = ", ".join(convolutions[:3]) + (f" and {len(convolutions) - 3} more" if len(convolutions) > 3 else "")
    problems = []
    if pack:
        problems.append(
            f"this model mixes neighbouring tokens with convolutions ({where}) that ignore document boundaries, so "
            "packed documents would leak into each other; train without --pack (lstune's limitation: restarting "
            "the convolution at each document start would lift it)."
        )
    if sp > 1:
        problems.append(
            f"this model mixes neighbouring tokens with convolutions ({where}), which under sequence parallelism "
            "would miss the previous rank's last tokens; use --sp 1 (lstune's limitation: exchanging that halo "
            "between ranks would lift it)."
        )
    raise ModelError("\n".join(problems), problems=problems)
