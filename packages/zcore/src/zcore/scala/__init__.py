"""ScaLA: adversarial noise on the embedding output for large-batch fine-tuning (issue 22).

- :mod:`~zcore.scala.config`: the ``scala`` config block (``enabled``, ``adv_steps`` = K,
  ``adv_step_size`` = alpha, ``adv_max_norm`` = epsilon, ``adv_init_mag`` = sigma,
  ``adv_norm``, ``adv_start_step`` = t_0, ``embedding``, ``seed``);
- :mod:`~zcore.scala.perturbation`: the random start, the ascent step and the projection;
- :mod:`~zcore.scala.scala`: :class:`ScaLA`, which hooks the embedding module and replaces a
  loop's ``engine.backward(loss); engine.step()`` with ``scala.step(loss_fn, mask)``.

Importing this package registers the ``scala`` block with ``zcore.config`` (so
``ZConfig.load`` validates it); import it before ``zcore.initialize`` reads a config that
has one::

    import zcore, zcore.scala
    engine, *_ = zcore.initialize(model, config=ds_config)  # ds_config holds "scala": {...}
    scala = zcore.scala.ScaLA(engine)
    for batch in loader:
        scala.step(lambda: loss_of(engine(**batch)), mask=batch["attention_mask"])
"""

from __future__ import annotations

from zcore.config.blocks import register_config_block
from zcore.scala.config import ScalaConfig
from zcore.scala.scala import ScaLA, ScalaStepResult, find_embedding, load_scala_config

register_config_block("scala", ScalaConfig)

__all__ = ["ScaLA", "ScalaConfig", "ScalaStepResult", "find_embedding", "load_scala_config"]
