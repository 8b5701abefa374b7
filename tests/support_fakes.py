"""The fakes, each at a true boundary: the sampler (the model's output, scripted or failing) and
the prompt's tokenizer (a hook before each encode). Everything between them stays real. The
sampler fake is passed to the constructor (``Engine(..., sampler=)``, ``AtomApp(..., sampler=)``),
never swapped into a built engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from atom_anyio.engine.sampler import Sampler, SamplerOutput, SamplingInputs


class FakeSampler:
    """The sampler a test drives: the real ``Sampler`` until the test scripts the output
    (``scripted``) or makes every step fail (``fail``), and the real one again after ``restore``."""

    def __init__(self) -> None:
        self.real = Sampler()
        self.fake: Callable[..., SamplerOutput] | None = None

    def __call__(self, logits: Any, inputs: SamplingInputs, finite: Any = None) -> SamplerOutput:
        return (self.fake or self.real)(logits, inputs, finite)

    def fail(self, error: Exception) -> None:
        self.fake = FailingSampler(error)

    def restore(self) -> None:
        self.fake = None


class ScriptedSampler:
    """The model boundary, faked: each row's next token is the next token of
    ``text`` (then EOS), whatever the logits say; ``fail_at`` raises at that
    output position, as a device error would. The forward, engine loop,
    detokenizer, parsers and API mapping all stay real."""

    def __init__(self, tokenizer: Any, text: str, fail_at: int | None = None):
        self.token_ids = tokenizer.encode(text, add_special_tokens=False)
        self.fail_at = fail_at

    def __call__(self, logits: Any, inputs: SamplingInputs, finite: Any = None) -> SamplerOutput:
        positions = [len(out) for out in inputs.output_token_ids]
        if self.fail_at is not None and self.fail_at in positions:
            raise RuntimeError("device lost")
        eos = inputs.eos_token_ids[0]
        ids = [self.token_ids[n] if n < len(self.token_ids) else eos for n in positions]
        return SamplerOutput(ids, [None] * len(ids))


class FailingSampler:
    """The model boundary failing, as a device error would: every step raises ``error``."""

    def __init__(self, error: Exception):
        self.error = error

    def __call__(self, logits: Any, inputs: SamplingInputs, finite: Any = None) -> SamplerOutput:
        raise self.error


class HookedSegmentCache:
    """The prompt's tokenizer boundary with a hook: ``hook(text)`` runs in the prepare thread
    before each encode (to block, record or fail it); the real segment cache does the work."""

    def __init__(self, real: Any, hook: Callable[[str], None]):
        self.real, self.hook = real, hook
        self.tokenizer = real.tokenizer

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.hook(text)
        return self.real.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def hook_prepare(atom: Any, hook: Callable[[str], None]) -> None:
    """Install a ``HookedSegmentCache`` in ``atom``'s prepare context (for the rest of its serving)."""
    rt = atom.runtime
    rt.prepare_ctx = dataclasses.replace(
        rt.prepare_ctx, segment_cache=HookedSegmentCache(rt.prepare_ctx.segment_cache, hook)
    )


def fake_sampler(engine: Any) -> FakeSampler:
    """The ``FakeSampler`` ``engine`` was built with."""
    sampler = engine.worker.sampler
    assert isinstance(sampler, FakeSampler), "build the engine (or serve the app) with sampler=FakeSampler()"
    return sampler


@contextmanager
def scripted(atom: Any, text: str, fail_at: int | None = None) -> Iterator[None]:
    """``atom``'s engine (served with a ``FakeSampler``) writes ``text`` for the block."""
    sampler = fake_sampler(atom.runtime.engine)
    sampler.fake = ScriptedSampler(atom.runtime.loaded.tokenizer, text, fail_at)
    try:
        yield
    finally:
        sampler.restore()
