"""Install lstune's per-document / head-parallel token mixers (lstune.models.mixers) on a model, undoably.

Here, in `train`, because it composes the model's structure (`models`), the instance patching of `memory` and the
SP exchange of `parallel`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from lstune.models.mixers import (
    DocumentMixer, DocumentPositions, ShardOrder, check_token_mixers, family_of, mixer_sites, probe_mixer,
)

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("lstune")


@dataclass
class MixersHandle:
    """What `install_mixers` did; `undo()` restores every mixer's forward and removes the positions hook."""

    names: list[str]
    undos: list[Callable[[], None]]
    wrappers: list[DocumentMixer] = field(default_factory=list)
    order: ShardOrder | None = None
    probe: bool = True

    def follow(self, chunks: Any) -> None:
        """Lay the head-parallel mixers' timeline out as the attention lays shards out with `chunks` (its
        AttentionChunks, `MemoryPlan.attn_chunking`: FPDT's pieces under SP), and probe them again on that layout.
        Nothing to do in one process."""
        if self.order is None or self.order.sp == 1:
            return
        self.order.follow(chunks)
        if self.probe and chunks is not None and chunks.setting != "off":
            for wrapper in self.wrappers:
                probe_mixer(wrapper)

    def undo(self) -> None:
        while self.undos:
            self.undos.pop()()


def install_mixers(body: "nn.Module", layers: "nn.ModuleList", *, pack: bool, exchange: Any = None,
                   probe: bool = True, chunks: Any = None, lm: "nn.Module | None" = None) -> MixersHandle | None:
    """Make every convolution-owning mixer in `layers` exact with packed documents (`pack`) and under SP (`exchange`,
    lstune.parallel.ulysses.SequenceExchange over the whole SP group, sp > 1, its ring part included); None when
    neither applies or there are none. Under SP the shards may be laid out in pieces (a ring's zigzag; FPDT's with
    chunked attention `chunks`, or later through `MixersHandle.follow`): the mixers put each head's gathered timeline
    in global order (`ShardOrder`). Each installed wrapper is probed against the module's own forward
    (`probe_mixer`); a mismatch raises ModelError. `lm`: the causal LM around `body`, whose position_ids are handed
    on to the body where it drops them (MambaForCausalLM, Mamba2ForCausalLM: `models.position_hooks`), so an
    LM-level call (the loss head's check, the self-check) sees the documents too."""
    from lstune.memory.patching import patch_forward
    from lstune.models.position_hooks import hand_on_positions

    sp = exchange.sp if exchange is not None else 1
    sites = mixer_sites(layers)
    if not sites or not (pack or sp > 1):
        return None
    check_token_mixers(layers, pack=pack, sp=sp, exchange=exchange)
    order = ShardOrder(sp, exchange.ring if sp > 1 else 1, chunks)
    positions = DocumentPositions(exchange if sp > 1 else None, order)
    handle = MixersHandle([], [], [], order, probe)
    if lm is not None and lm is not body:  # before the body's hook below, which then reads what the LM was given
        handle.undos.extend(hand_on_positions(lm, [body]))
    handle.undos.append(body.register_forward_pre_hook(positions.hook, with_kwargs=True).remove)
    try:
        for name, module in sites:
            wrapper = DocumentMixer(module, name, module.forward, positions, family_of(module), exchange)
            handle.undos.append(patch_forward(module, wrapper, what="per-document / head-parallel mixer"))
            handle.names.append(name)
            handle.wrappers.append(wrapper)
            if probe:
                probe_mixer(wrapper)
    except BaseException:
        handle.undo()
        raise
    how = f"head-parallel over SP {sp}" if sp > 1 else "per packed document"
    log.info("token mixers %s: %s", how, ", ".join(handle.names))
    return handle
