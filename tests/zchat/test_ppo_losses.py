"""PPO's losses against readable per-token references (plain Python loops over each row's
real tokens, written from the formulas in InstructGPT / DeepSpeed-Chat); tolerance 1e-6
(fp64 inputs, so only the order of the sums differs)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from zchat.ppo.losses import gae, kl_penalized_rewards, masked_mean, policy_loss, value_loss

B, T = 3, 5
LENGTHS = [5, 3, 1]  # right-padded responses


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=torch.float64)

    def r(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(B, T, generator=g, dtype=torch.float64) * scale

    return {
        "mask": mask,
        "logp": r(0.5) - 2,
        "ref": r(0.5) - 2,
        "old": r(0.5) - 2,
        "values": r(),
        "old_values": r(),
        "returns": r(),
        "adv": r(),
        "scores": torch.tensor([7.5, -0.3, -9.0], dtype=torch.float64),
    }


def test_rewards_penalise_kl_on_every_token_and_add_the_clipped_score_at_the_end() -> None:
    b = batch(0)
    got = kl_penalized_rewards(b["logp"], b["ref"], b["scores"], b["mask"], 0.1, 5.0)
    for i, n in enumerate(LENGTHS):
        for t in range(T):
            want = 0.0
            if t < n:
                want = -0.1 * (float(b["logp"][i, t]) - float(b["ref"][i, t]))
            if t == n - 1:
                want += max(-5.0, min(5.0, float(b["scores"][i])))
            assert float(got[i, t]) == pytest.approx(want, abs=1e-6), (i, t)


def test_gae_against_the_backward_recursion_per_row() -> None:
    b = batch(1)
    rewards = b["ref"] * b["mask"]
    gamma, lam = 0.9, 0.95
    adv, ret = gae(rewards, b["values"], b["mask"], gamma, lam)
    for i, n in enumerate(LENGTHS):
        v = [float(x) for x in b["values"][i, :n]] + [0.0]  # nothing after the end
        r = [float(x) for x in rewards[i, :n]]
        a_next = 0.0
        want = [0.0] * n
        for t in reversed(range(n)):
            delta = r[t] + gamma * v[t + 1] - v[t]
            a_next = delta + gamma * lam * a_next
            want[t] = a_next
        assert adv[i, :n].tolist() == pytest.approx(want, abs=1e-6)
        assert ret[i, :n].tolist() == pytest.approx(
            [a + v[t] for t, a in enumerate(want)], abs=1e-6
        )
        assert adv[i, n:].abs().sum() == 0 and ret[i, n:].abs().sum() == 0


def test_policy_loss_is_the_clipped_surrogate() -> None:
    b = batch(2)
    loss, info = policy_loss(b["logp"], b["old"], b["adv"], b["mask"], 0.2)
    terms, clipped = [], 0
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            ratio = math.exp(float(b["logp"][i, t]) - float(b["old"][i, t]))
            a = float(b["adv"][i, t])
            plain, held = -a * ratio, -a * max(0.8, min(1.2, ratio))
            terms.append(max(plain, held))
            clipped += held > plain
    assert float(loss) == pytest.approx(sum(terms) / len(terms), abs=1e-6)
    assert info["clip_frac"] == pytest.approx(clipped / len(terms))
    # the gradient flows through the unclipped ratios only
    logp = b["logp"].clone().requires_grad_(True)
    policy_loss(logp, b["old"], b["adv"], b["mask"], 0.2)[0].backward()
    assert logp.grad is not None and float(logp.grad[2, 1:].abs().sum()) == 0.0  # padding


def test_value_loss_is_the_clipped_squared_error() -> None:
    b = batch(3)
    got = value_loss(b["values"], b["old_values"], b["returns"], b["mask"], 0.2)
    terms = []
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            v, old, ret = (float(b[k][i, t]) for k in ("values", "old_values", "returns"))
            v_clip = min(max(v, old - 0.2), old + 0.2)
            terms.append(0.5 * max((v - ret) ** 2, (v_clip - ret) ** 2))
    assert float(got) == pytest.approx(sum(terms) / len(terms), abs=1e-6)


def test_masked_mean_of_nothing_is_zero() -> None:
    assert float(masked_mean(torch.ones(2, 3), torch.zeros(2, 3))) == 0.0


def test_masked_whiten_uses_only_the_real_tokens() -> None:
    from zchat.ppo.losses import masked_whiten

    x = torch.tensor([[1.0, 2.0, 7.0], [3.0, 100.0, -50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    real = [1.0, 2.0, 7.0, 3.0]
    mean = statistics.fmean(real)
    std = statistics.pstdev(real)  # the biased variance, as TRL's whiten
    got = masked_whiten(x, mask)
    want = [[(v - mean) / std for v in real[:3]], [(real[3] - mean) / std, 0.0, 0.0]]
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)
