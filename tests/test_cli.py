from support_replay.cli import main


def test_demo_runs_and_replay_ratio_is_exactly_one(capsys):
    assert main(["demo", "--tokens", "256", "--vocab", "500", "--semantics", "sglang", "vllm"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| sglang") or line.startswith("| vllm")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[8]) < 1e-5  # the sampler's log mu against an independent float64 computation
        assert cells[6] == "1.000" and cells[7] == "0.0%"  # replayed ratio: the trainer's score equals it
        assert float(cells[4]) < 0.99  # full-vocabulary scoring is biased low under top_p 0.8


def test_demo_rejects_bad_settings(capsys):
    assert main(["demo", "--top-p", "0", "--tokens", "8", "--vocab", "50"]) == 2
    assert "top_p: must be in (0, 1], got 0.0" in capsys.readouterr().err
