"""Compact deltas whose streams once overflowed the decoder's buffer.

A group where more than half the members changed codes its unchanged members, and the
decoder writes the changed ones in the gaps between them. Gaps that jump past members once
wrote more ranks than the group has changes: in the last group, past the end of the buffer,
a heap overflow that killed the process (glibc's `free(): invalid next size`). Such streams
are made here as an attacker with write access to a bucket makes them: one bit of a real
stream flipped, and the file's payload digest computed again so that the decoder itself must
refuse it. The decoder now refuses them with a message of their own ([`PAST_SLOTS`]), which
is how they are picked out here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from delta_sync.compact import SUFFIX, decode_changes
from delta_sync.errors import FormatError
from delta_sync.integrity import payload_digest


def change_most_of(weight: torch.Tensor, seed: int = 1) -> None:
    """Scale about 70% of `weight`'s elements by 1.05, in place: enough for its stream to code
    the unchanged members of most groups."""
    generator = torch.Generator().manual_seed(seed)
    kept = torch.rand(weight.shape, generator=generator) < 0.3
    with torch.no_grad():
        weight.copy_(torch.where(kept, weight, weight * 1.05))


#: What the decoder says of such a stream.
PAST_SLOTS = "the unchanged members coded leave more changed members than the group claims"


def overflowing_copies(data: bytes, held: Mapping[str, torch.Tensor], count: int = 3) -> list[tuple[str, bytes]]:
    """Up to `count` copies of the compact delta file `data`, each with one bit of one stream
    flipped so that it once overflowed, and sealed again; as (tensor name, file bytes).

    Args:
        data: A compact delta file.
        held: Parameter name -> the bf16 weights the delta applies to.
        count: How many copies to make.
    """
    tensors = load_safetensors(data)
    metadata = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    streams = sorted((name for name in tensors if name.endswith(SUFFIX)), key=lambda name: -tensors[name].numel())
    copies = []
    for name in streams:
        parameter = name.removesuffix(SUFFIX)
        previous = {parameter: held[parameter]}
        shapes = {parameter: tuple(held[parameter].shape)}
        stream = tensors[name]
        for byte in range(stream.numel()):
            for bit in range(8):
                damaged = stream.clone()
                damaged[byte] ^= 1 << bit
                try:
                    decode_changes({name: damaged}, previous, shapes, source="probe")
                except FormatError as exc:
                    if PAST_SLOTS not in str(exc):
                        continue
                else:
                    continue
                sealed = {**tensors, name: damaged}
                digest = payload_digest(sealed.items())
                copies.append((parameter, save_safetensors(sealed, metadata={**metadata, "payload_xxh3": digest})))
                if len(copies) == count:
                    return copies
    return copies
