"""ScaLA on a zcore engine: adversarial noise on the embedding output, then the engine's step.

One training step (:meth:`ScaLA.step`) on a micro-batch, with ``loss_fn`` the caller's
closure that runs the engine's forward on that batch and returns the scalar loss:

1. ``delta_0``: zero, or a random start of magnitude ``adv_init_mag`` (:mod:`.perturbation`);
2. ``adv_steps`` times: forward with ``delta`` added to the embedding output, the gradient of
   the loss with respect to ``delta`` only (``torch.autograd.grad``: no weight gradient is
   formed, so the engine's gradient hooks, reductions and accumulation never see these
   passes), an ascent step of ``adv_step_size``, projection into the ``adv_max_norm`` ball;
3. one more forward at ``x + delta`` (``delta`` held constant), then ``engine.backward`` and
   ``engine.step`` exactly as a plain loop calls them: ZeRO's partitioning, reduction,
   clipping, loss scaling and gradient accumulation are the engine's own, untouched.

The perturbation is added by a forward hook on the embedding module (found by name or by
``get_input_embeddings()``), so any Hugging Face encoder or decoder works without editing the
model or ``engine.py``; outside :meth:`ScaLA.step` (evaluation, a plain step) the hook adds
nothing. Every pass of one step starts from the same global RNG state, so dropout drops the
same units in the ascent passes as in the pass the weights learn from, and the RNG stream
after the step is the plain loop's: with ``adv_max_norm`` 0 the step equals the plain step
bit for bit. Data-parallel ranks need no extra communication: each sample's ascent is its
own (see :mod:`.perturbation`), so the ranks together perturb the global batch as one
process would.

ZeRO stages 0-2. Stage 3 gathers parameters in forward and releases them as their gradients
arrive, which the gradient-free ascent passes never produce, so it is refused at start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from torch import nn

from zcore.config._convert import problems_from
from zcore.config.errors import ConfigError
from zcore.scala.config import ScalaConfig
from zcore.scala.perturbation import ascend, initial, project, sample_norms

if TYPE_CHECKING:
    from zcore.engine import ZEngine


def load_scala_config(raw: ScalaConfig | Mapping[str, Any] | None) -> ScalaConfig:
    """``raw`` validated as a ``scala`` block (ConfigError naming ``scala.<key>`` otherwise);
    None gives the defaults (off)."""
    if isinstance(raw, ScalaConfig):
        return raw
    try:
        return ScalaConfig.model_validate({} if raw is None else dict(raw))
    except ValidationError as error:
        raise ConfigError(problems_from(error, ScalaConfig, "scala")) from None


def find_embedding(model: nn.Module, name: str | None) -> tuple[str, nn.Module]:
    """(name, module) whose output ScaLA perturbs: ``name`` from ``named_modules()``, or the
    model's ``get_input_embeddings()``."""
    modules = dict(model.named_modules())
    embeddings = [n for n, m in modules.items() if isinstance(m, nn.Embedding)]
    if name is not None:
        if name not in modules:
            raise ConfigError.single(
                "scala.embedding",
                name,
                f"is not a module of {type(model).__name__}; its nn.Embedding modules are "
                f"{embeddings}",
            )
        return name, modules[name]
    get = getattr(model, "get_input_embeddings", None)
    module = get() if callable(get) else None
    if not isinstance(module, nn.Module):
        raise ConfigError.single(
            "scala.embedding",
            None,
            f"{type(model).__name__} has no get_input_embeddings(); set scala.embedding to the "
            f"module whose output to perturb, one of {embeddings}",
        )
    found = next((n for n, m in modules.items() if m is module), "get_input_embeddings()")
    return found, module


@dataclass(frozen=True)
class ScalaStepResult:
    """What one :meth:`ScaLA.step` did."""

    loss: float
    """The loss the weights stepped on (at ``x + delta`` when ``adversarial``)."""
    start_loss: float | None
    """The loss at ``delta_0``, before any ascent (the clean loss when ``adv_init_mag`` is 0);
    None for a plain step."""
    adversarial: bool
    """Whether noise was applied (enabled, and ``adv_start_step`` reached)."""
    delta_norm: float
    """The largest per-sample norm (in ``adv_norm``) of the ``delta`` used; 0 for a plain step."""


class ScaLA:
    """ScaLA's inner ascent on an engine's model; :meth:`step` replaces ``backward`` + ``step``."""

    def __init__(
        self, engine: ZEngine, config: ScalaConfig | Mapping[str, Any] | None = None
    ) -> None:
        """``config``: the ``scala`` block (a model or a dict); None reads
        ``engine.config.extension("scala")`` (off when the config has no such block)."""
        if config is None:
            config = engine.config.extension("scala")
        self.config = load_scala_config(config)
        if self.config.enabled and engine.stage == 3:
            raise ConfigError.single(
                "zero_optimization.stage",
                3,
                "scala runs on ZeRO stages 0-2 (stage 3 releases gathered weights only when "
                "their gradients arrive, which ScaLA's ascent passes do not form); use stage "
                "2, or scala.enabled false",
            )
        self.engine = engine
        self.embedding_name, self.embedding = find_embedding(engine.module, self.config.embedding)
        # one stream per data rank: ranks that read the same data draw the same noise
        seed = self.config.seed + 1009 * engine.data_rank
        self._generator = torch.Generator().manual_seed(seed)
        self._mode: str | None = None  # None: hook adds nothing; "ascent"; "final"
        self._delta: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._hook = self.embedding.register_forward_hook(self._add_delta)

    @property
    def delta(self) -> torch.Tensor | None:
        """The perturbation of the last adversarial step (fp32, the embedding output's shape)."""
        return self._delta

    def close(self) -> None:
        """Take the hook off the embedding module (the model is then as before)."""
        self._hook.remove()

    def _add_delta(self, module: nn.Module, args: Any, out: Any) -> Any:
        if self._mode is None:
            return None
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"scala.embedding `{self.embedding_name}` returned {type(out).__name__}, not a "
                "tensor; set scala.embedding to a module whose output is the embedding tensor"
            )
        c = self.config
        if self._delta is None:
            self._delta = project(
                initial(
                    out.shape,
                    c.adv_init_mag,
                    c.adv_norm,
                    mask=self._mask,
                    generator=self._generator,
                    device=out.device,
                ),
                c.adv_max_norm,
                c.adv_norm,
                self._mask,
            )
            if self._mode == "ascent":
                self._delta.requires_grad_(True)
        elif self._delta.shape != out.shape:
            raise RuntimeError(
                f"scala: `{self.embedding_name}` returned shape {tuple(out.shape)} after "
                f"{tuple(self._delta.shape)} in the same step; loss_fn must run one forward of "
                "one batch"
            )
        delta = self._delta if self._mode == "ascent" else self._delta.detach()
        return out + delta.to(out.dtype)

    def step(
        self, loss_fn: Callable[[], torch.Tensor], mask: torch.Tensor | None = None
    ) -> ScalaStepResult:
        """One micro-step: ``loss_fn()`` (the engine's forward on one micro-batch, returning
        the scalar loss) is called ``adv_steps + 1`` times; then ``engine.backward`` and
        ``engine.step``. ``mask``: the batch's ``(B, T)`` attention mask, so padding gets no
        noise. Before ``adv_start_step`` optimizer steps (or when off) it is the plain step."""
        c, engine = self.config, self.engine
        if not c.enabled or engine.global_steps < c.adv_start_step:
            loss = loss_fn()
            engine.backward(loss)
            engine.step()
            return ScalaStepResult(float(loss.detach()), None, False, 0.0)
        rng = _RngState(self.embedding)
        self._delta, self._mask = None, mask
        start_loss: float | None = None
        try:
            for k in range(c.adv_steps):
                rng.restore()
                self._mode = "ascent"
                if self._delta is not None:
                    self._delta = self._delta.detach().requires_grad_(True)
                loss = loss_fn()
                if self._delta is None:
                    raise RuntimeError(
                        f"scala: loss_fn did not run `{self.embedding_name}`; set "
                        "scala.embedding to the module that embeds the batch"
                    )
                if k == 0:
                    start_loss = float(loss.detach())
                # scaled like the engine's backward so fp16 gradients do not underflow; the
                # ascent normalizes the gradient, so the scale does not change the step
                (grad,) = torch.autograd.grad(loss * engine.loss_scale, self._delta)
                with torch.no_grad():
                    if bool(torch.isfinite(grad).all()):  # an overflow keeps delta
                        moved = ascend(self._delta, grad.float(), c.adv_step_size, c.adv_norm, mask)
                        self._delta = project(moved, c.adv_max_norm, c.adv_norm, mask)
            rng.restore()
            self._delta = self._delta.detach() if self._delta is not None else None
            self._mode = "final"
            loss = loss_fn()
        finally:
            self._mode = None
        engine.backward(loss)
        engine.step()
        norm = (
            float(sample_norms(self._delta, c.adv_norm).max()) if self._delta is not None else 0.0
        )
        return ScalaStepResult(float(loss.detach()), start_loss, True, norm)


class _RngState:
    """The global RNG state (CPU, and the model's CUDA device) at the start of a step, to
    start every pass of the step from it."""

    def __init__(self, module: nn.Module) -> None:
        self.cpu = torch.get_rng_state()
        p = next(module.parameters(), None)
        self.device = p.device if p is not None and p.device.type == "cuda" else None
        self.cuda = torch.cuda.get_rng_state(self.device) if self.device is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
