"""`--plot`: a PNG written whole, one series per label (this run first), baselines from lmd, vLLM and SGLang files."""

from __future__ import annotations

import json
import math

import pytest

from lmd.bench.result_file import merge_series, read_baseline, series_of
from tests.eval.test_cli import run_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _vllm_result(concurrency: int, tok_s: float) -> dict:
    """The keys of `vllm bench serve --save-result` that a plot reads."""
    return {"backend": "vllm", "max_concurrency": concurrency, "num_prompts": 100, "output_throughput": tok_s,
            "median_ttft_ms": 20.0, "p99_ttft_ms": 40.0, "median_tpot_ms": 5.0, "p99_tpot_ms": 7.5}  # fmt: skip


def _lmd_run(concurrency: int | None, tok_s: float) -> dict:
    summary = {"count": 4, "mean": 2.0, "median": 2.0, "p90": 3.0, "p99": 4.0, "min": 1.0, "max": 4.0}
    return {"concurrency": concurrency, "requests": 16, "output_tokens_per_s": tok_s, "ttft_ms": summary,
            "tpot_ms": None}  # fmt: skip


def test_result_files_become_series(tmp_path):
    (tmp_path / "v1.json").write_text(json.dumps(_vllm_result(1, 90.0)))
    (tmp_path / "v8.json").write_text(json.dumps(_vllm_result(8, 600.0)))
    sglang = tmp_path / "sglang.jsonl"  # SGLang appends one JSON line per run
    sglang.write_text("\n".join(json.dumps(_vllm_result(c, 10.0 * c)) for c in (4, 2)) + "\n")
    engine = tmp_path / "engine.json"  # `lmd bench throughput --json`: one run
    engine.write_text(json.dumps(_lmd_run(8, 700.0)))
    series = merge_series(
        [read_baseline(f"vllm={tmp_path / 'v8.json'}"), read_baseline(f"vllm={tmp_path / 'v1.json'}"),
         read_baseline(str(sglang)), read_baseline(str(engine))]
    )  # fmt: skip
    assert [s.label for s in series] == ["vllm", "sglang", "engine"]
    assert [p.concurrency for p in series[0].points] == [1, 8] and series[0].points[1].tpot_p99_ms == 7.5
    assert [p.output_tokens_per_s for p in series[1].points] == [20.0, 40.0]
    (point,) = series[2].points
    assert point.ttft_p50_ms == 2.0 and point.ttft_p99_ms == 4.0 and math.isnan(point.tpot_p50_ms)
    sweep = {"label": "lmd", "runs": [_lmd_run(4, 1.0), _lmd_run(None, 2.0)]}
    assert [p.concurrency for p in series_of(sweep, "lmd").points] == [4, 16]  # no limit: all 16 requests


def test_figure_has_a_series_per_label(tmp_path):
    from lmd.bench.plot import draw, save
    from lmd.bench.result_file import Series

    own = series_of({"runs": [_lmd_run(1, 50.0), _lmd_run(8, 300.0)]}, "lmd")
    base = read_baseline(_write(tmp_path / "v.json", _vllm_result(8, 400.0)))
    figure = draw([own, Series("v", base.points)], "title")
    throughput, ttft, tpot = figure.axes
    assert [line.get_label() for line in throughput.get_lines()] == ["lmd", "v"]
    assert [line.get_label() for line in ttft.get_lines()] == ["lmd p50", "lmd p99", "v p50", "v p99"]
    assert len(tpot.get_lines()) == 4 and list(throughput.get_lines()[0].get_xdata()) == [1, 8]
    out = tmp_path / "plot.png"
    save(figure, out)
    assert out.read_bytes().startswith(PNG_MAGIC) and list(tmp_path.glob(".plot.png.tmp-*")) == []


@pytest.fixture
def figures(monkeypatch) -> list:
    """Every figure the commands draw, in order (plot.draw spied on)."""
    from lmd.bench import plot

    real_draw, drawn = plot.draw, []

    def spy(series, title):
        drawn.append(real_draw(series, title))
        return drawn[-1]

    monkeypatch.setattr(plot, "draw", spy)
    return drawn


def _write(path, body: dict) -> str:
    path.write_text(json.dumps(body))
    return str(path)


def test_bench_serve_plots_beside_baselines(server_url, bench_ws, tmp_path, monkeypatch, capsys, figures):
    a = _write(tmp_path / "a.json", _vllm_result(1, 90.0))
    b = _write(tmp_path / "b.json", _vllm_result(2, 150.0))
    image = tmp_path / "cmp.png"
    args = ["bench", "serve", server_url, "--tokenizer", str(bench_ws), "--dataset", "random", "--random-input-len",
            "4", "--num-prompts", "3", "--fixed-output-len", "3", "--max-concurrency", "1,2", "--label", "lmd serve",
            "--plot", str(image), "--baseline", f"vllm={a}", "--baseline", f"vllm={b}"]  # fmt: skip
    code, _, err = run_main(monkeypatch, capsys, *args)
    assert code == 0, err
    assert image.read_bytes().startswith(PNG_MAGIC)
    (figure,) = figures
    assert [line.get_label() for line in figure.axes[0].get_lines()] == ["lmd serve", "vllm"]
    assert all(list(line.get_xdata()) == [1, 2] for line in figure.axes[1].get_lines())
    code, _, err = run_main(monkeypatch, capsys, *args)  # the image exists now
    assert code == 1 and "--plot" in err and "already exists; pass --force" in err


def test_bench_throughput_sweep_plots_and_saves_beside_a_baseline(bench_ws, tmp_path, monkeypatch, capsys, figures):
    vllm = _write(tmp_path / "v.json", _vllm_result(2, 150.0))
    image, saved = tmp_path / "engine.png", tmp_path / "engine.json"
    args = ["bench", "throughput", str(bench_ws), "--dataset", "random", "--random-input-len", "4", "--num-prompts",
            "3", "--fixed-output-len", "3", "--concurrency", "1,2", "--device", "cpu", "--cache-block-seq-len", "8",
            "--session-len", "256", "--label", "engine", "--plot", str(image), "--save-result", str(saved),
            "--baseline", f"vllm={vllm}"]  # fmt: skip
    code, _, err = run_main(monkeypatch, capsys, *args)
    assert code == 0, err
    assert image.read_bytes().startswith(PNG_MAGIC) and sorted(p.name for p in tmp_path.iterdir()) == [
        "engine.json", "engine.png", "v.json"]  # fmt: skip
    report = json.loads(saved.read_text())
    assert report["label"] == "engine" and [r["concurrency"] for r in report["runs"]] == [1, 2]
    (figure,) = figures
    throughput, ttft, tpot = figure.axes
    assert [line.get_label() for line in throughput.get_lines()] == ["engine", "vllm"]
    assert [line.get_label() for line in ttft.get_lines()] == ["engine p50", "engine p99", "vllm p50", "vllm p99"]
    own = throughput.get_lines()[0]
    assert list(own.get_xdata()) == [1, 2]
    assert list(own.get_ydata()) == [r["output_tokens_per_s"] for r in report["runs"]]
    assert list(ttft.get_lines()[1].get_ydata()) == [r["ttft_ms"]["p99"] for r in report["runs"]]
    assert list(tpot.get_lines()[0].get_ydata()) == [r["tpot_ms"]["median"] for r in report["runs"]]
    assert [p.concurrency for p in read_baseline(str(saved)).points] == [1, 2]  # the saved sweep is a baseline too
    args[args.index("1,2")] = "4"  # one value, over the same files
    code, _, err = run_main(monkeypatch, capsys, *args)
    assert code == 1 and "--save-result" in err and "already exists; pass --force" in err
    code, _, err = run_main(monkeypatch, capsys, *args, "--force")
    assert code == 0, err
    single = json.loads(saved.read_text())
    assert set(single) == set(report["runs"][0]) and single["concurrency"] == 4  # the single run's --json object
    assert [line.get_xdata().tolist() for line in figures[-1].axes[0].get_lines()] == [[4], [2]]
