"""`z estimate-memory` through Typer's test runner: the JSON agrees with `zcore.memory`,
the table covers every stage and its offload options, and bad input exits 2 with a
message naming the problem and no traceback."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from zcore.memory import format_bytes, model_state_bytes
from zstack.cli import app
from zstack.cmd_memory import TABLE_ROWS

runner = CliRunner()


def z(*args: str):
    return runner.invoke(app, ["estimate-memory", *args])


def flat(text: str) -> str:
    """Error text without Rich's panel borders and line wrapping."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_json_for_one_stage_matches_zcore() -> None:
    out = z("--params", "7.5B", "--world-size", "64", "--stage", "3", "--json")
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert got == model_state_bytes(7_500_000_000, 64, 3).to_dict()
    assert got["total"] == 16 * 7_500_000_000 // 64


def test_json_with_offload_and_nodes() -> None:
    out = z(
        "--params",
        "1.3e9",
        "--world-size",
        "16",
        "--gpus-per-node",
        "8",
        "--stage",
        "3",
        "--offload-optimizer",
        "cpu",
        "--offload-param",
        "nvme",
        "--largest-layer",
        "50M",
        "--json",
    )
    assert out.exit_code == 0, out.output
    expected = model_state_bytes(
        1_300_000_000,
        16,
        3,
        offload_optimizer="cpu",
        offload_param="nvme",
        gpus_per_node=8,
        largest_layer_params=50_000_000,
    )
    assert json.loads(out.stdout) == expected.to_dict()
    assert expected.nvme_per_rank > 0 and expected.host_per_node > 0


def test_json_without_stage_lists_every_row() -> None:
    out = z("--params", "125M", "--world-size", "4", "--json")
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert (got["num_params"], got["world_size"], got["gpus_per_node"]) == (125_000_000, 4, 4)
    rows = [(e["stage"], e["offload_optimizer"], e["offload_param"]) for e in got["estimates"]]
    assert rows == list(TABLE_ROWS)
    assert {e["stage"] for e in got["estimates"]} == {0, 1, 2, 3}
    for e, (stage, opt, par) in zip(got["estimates"], TABLE_ROWS, strict=True):
        assert (
            e
            == model_state_bytes(
                125_000_000, 4, stage, offload_optimizer=opt, offload_param=par
            ).to_dict()
        )


def test_table_mentions_every_stage_in_human_units() -> None:
    out = z("--params", "1.3B", "--world-size", "8")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert "1,300,000,000 params on 8 ranks" in lines[0]
    header = lines[1]
    assert "stage" in header and "per device" in header and "host per node" in header
    body = lines[2 : 2 + len(TABLE_ROWS)]
    assert [line.split()[:3] for line in body] == [[str(s), o, p] for s, o, p in TABLE_ROWS]
    stage0 = format_bytes(16 * 1_300_000_000)
    assert stage0 == "19.37 GiB" and stage0 in body[0]
    assert "MiB" in out.stdout and "--largest-layer" in out.stdout


def test_offload_option_filters_the_table() -> None:
    out = z("--params", "1.3B", "--world-size", "8", "--offload-optimizer", "nvme")
    assert out.exit_code == 0, out.output
    stages = [line.split()[0] for line in out.stdout.splitlines()[2:] if line[:5].strip().isdigit()]
    assert stages == ["1", "2", "3", "3", "3"]


@pytest.mark.parametrize("stage", ["4", "-1"])
def test_bad_stage_exits_2(stage: str) -> None:
    out = z("--params", "1B", "--world-size", "8", "--stage", stage)
    assert out.exit_code == 2
    message = flat(out.stderr)
    assert "--stage" in message and "Traceback" not in out.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--params", "1.3X"], ["`--params`", "'1.3X'", '"1.3B"']),
        (["--params", "1B", "--largest-layer", "lots"], ["`--largest-layer`", "'lots'"]),
        (
            ["--params", "1B", "--stage", "2", "--offload-param", "cpu"],
            ["offload_param", "stage 3"],
        ),
        (["--params", "1B", "--stage", "0", "--offload-optimizer", "cpu"], ["stage 1, 2 or 3"]),
        (["--params", "1B", "--gpus-per-node", "3"], ["world_size 8", "gpus_per_node 3"]),
        (["--params", "1B", "--stage", "1", "--largest-layer", "1M"], ["stage 3 only"]),
        (
            ["--params", "1B", "--offload-param", "cpu", "--offload-optimizer", "none"],
            ["--stage 3"],
        ),
        (["--params", "0"], ["params", ">= 1"]),
    ],
)
def test_bad_input_exits_2_with_the_value(args: list[str], words: list[str]) -> None:
    out = z("--world-size", "8", *args)
    assert out.exit_code == 2, out.output
    assert out.stdout == ""
    assert out.stderr.startswith("error: ")
    for word in words:
        assert word in out.stderr
    assert "Traceback" not in out.output


def test_bad_offload_device_exits_2() -> None:
    out = z("--params", "1B", "--world-size", "8", "--offload-optimizer", "gpu")
    assert out.exit_code == 2
    message = flat(out.stderr)
    assert "--offload-optimizer" in message and "gpu" in message
