"""benchmarks/published.py: its rows are autotune's flags, a bad row is one line and exit 2, a row's machinery end to
end on a tiny model; and the models its rows name (benchmarks/published_models.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import published
from benchmarks.litgpt_models import litgpt_lora, litgpt_step
from benchmarks.published_models import bert_classifier, llama3_torchtitan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"n_layer": 2, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}


def test_every_row_parses_as_autotunes_flags_or_says_why_it_cannot_be_expressed():
    published.check(published.ROWS)  # raises RowError naming the first row autotune's parser refuses
    by_id = {row.id: row for row in published.ROWS}
    assert by_id["torchtitan-8b-fsdp-8"].args and by_id["torchtitan-8b-fsdp-8"].published_bytes == round(82.4 * 2**30)
    assert by_id["hf-bert-b4"].statistic == "NVML used" and by_id["hf-bert-b4"].published_bytes == 14949 * 2**20
    for row in published.ROWS:
        assert (row.args is None) != (row.why_not is None), row.id
        assert row.command is None or (row.command.startswith("python -m autotune ") and row.command.endswith(
            " --dry-run"))


def _run(tmp_path, rows: list[dict], *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "published.py"), "--rows", str(path),
                           "--out", str(tmp_path / "out"), *extra], cwd=ROOT, text=True, capture_output=True,
                          timeout=240)


def _row(id: str, args: list[str] | None, statistic: str = "max_memory_reserved", **fields) -> dict:
    return {"id": id, "source": "https://example.org/paper (a test)", "where": "Table 1", "config": "TinyGPT, tiny",
            "statistic": statistic, "published": 100, "unit": "MiB", "args": args, **fields}


@pytest.mark.parametrize("args, says", [
    (["--model", "autotune.examples:TinyGPT", "--no-such-option", "3"], "unrecognized arguments: --no-such-option"),
    (["--model", "autotune.examples:TinyGPT", "--precisions", "fp64"], "fp64"),
    (["--model", "autotune.examples:TinyGPT", "--out", "x.json"], "--out is added by"),
])
def test_a_row_autotune_would_refuse_is_one_line_and_exit_2_before_anything_runs(tmp_path, args, says):
    done = _run(tmp_path, [_row("fine", None, why_not="a reason"), _row("bad", args)])
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("published.py: row bad: ") and says in lines[0], done.stderr
    assert not (tmp_path / "out").exists()


def test_rows_without_a_reason_or_with_an_unknown_statistic_are_refused(tmp_path):
    for rows, says in (([_row("r", None)], "either the arguments"), ([_row("r", [], statistic="p99")], "statistic"),
                       ([{**_row("r", None, why_not="x"), "colour": 1}], "unknown field colour")):
        done = _run(tmp_path, rows)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and says in done.stderr


def test_a_row_is_predicted_and_read_by_its_statistic(tmp_path):
    """Two statistics of one configuration (one dry run): the reserved bytes, and NVML's, which adds the context."""
    args = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", json.dumps(TINY), "--device", "cuda",
            "--cuda-context", "300MiB", "--budget", "1GiB", "--precisions", "fp32", "--segments", "0",
            "--batch-sizes", "4"]
    rows = [_row("reserved", args), _row("nvml", args, statistic="NVML used", published=400.5),
            _row("not", None, why_not="it needs a GPU we do not model")]
    done = _run(tmp_path, rows, "--reports", str(tmp_path / "reports"))
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "out" / "published-cpu.json").read_text())
    reserved, nvml, absent = data["rows"]
    assert list(reserved)[:8] == ["source", "config", "statistic", "published_bytes", "predicted_bytes", "error",
                                  "command", "id"]
    (trial,) = json.loads((tmp_path / "reports" / "reserved.json").read_text())["trials"]
    assert reserved["predicted_bytes"] == trial["peak_reserved_bytes"] > 0
    assert nvml["predicted_bytes"] == trial["peak_nvml_bytes"] == trial["peak_reserved_bytes"] + 300 * 2**20
    assert not (tmp_path / "reports" / "nvml.json").exists()  # the same arguments ran once
    assert reserved["error"] == round(reserved["predicted_bytes"] / (100 * 2**20) - 1, 4)
    assert nvml["published_bytes"] == round(400.5 * 2**20)
    assert reserved["command"] == "python -m autotune " + " ".join(
        f"'{a}'" if "{" in a else a for a in args) + " --dry-run"
    assert absent["predicted_bytes"] is None and absent["error"] is None and absent["command"] is None
    assert absent["why_not"] == "it needs a GPU we do not model"
    md = (tmp_path / "out" / "published-cpu.md").read_text()
    assert "| reserved |" in md and "not expressed: it needs a GPU we do not model" in md
    assert f"{reserved['error'] * 100:+.1f}%" in md


def test_a_throughput_row_is_the_predicted_samples_per_s_in_its_unit(tmp_path):
    args = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", json.dumps(TINY), "--device", "cuda",
            "--card", "rtx4090", "--precisions", "bf16", "--segments", "0", "--batch-sizes", "4"]
    rows = [_row("tps", args, statistic="throughput", published=5000, unit="tokens/s per GPU", per_sample=32 / 2)]
    done = _run(tmp_path, rows, "--reports", str(tmp_path / "reports"))
    assert done.returncode == 0, done.stderr
    (row,) = json.loads((tmp_path / "out" / "published-cpu.json").read_text())["rows"]
    (trial,) = json.loads((tmp_path / "reports" / "tps.json").read_text())["trials"]
    assert trial["time_source"] == "predicted" and trial["time_model"] == "rtx4090"
    assert row["published_per_s"] == 5000 and row["predicted_per_s"] == round(trial["samples_per_s"] * 16, 2) > 0
    assert row["error"] == round(row["predicted_per_s"] / 5000 - 1, 4)
    assert "tokens/s per GPU" in (tmp_path / "out" / "published-cpu.md").read_text()


def test_llama3_torchtitan_is_llama_3_8b():
    with torch.device("meta"):
        model = llama3_torchtitan()
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama 3 8B's count
    assert type(model.layers).__name__ == "ModuleDict" and len(model.layers) == 32  # keyed "0".."31" as torchtitan's


def test_berts_attention_of_2022_computes_eager_attention_and_keeps_the_softmax_input():
    shape = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
             "seq_len": 16, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    models = {}
    for attention in ("eager", "2022"):
        torch.manual_seed(0)
        models[attention] = bert_classifier(attention=attention, **shape)
    batch = models["eager"].example_batch(3)
    losses = {name: model(**batch).loss for name, model in models.items()}
    for loss in losses.values():
        loss.backward()
    assert torch.equal(losses["eager"], losses["2022"])
    for (name, a), b in zip(models["eager"].named_parameters(), models["2022"].parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    scores = {}  # the (batch, heads, seq, seq) tensors each model keeps for backward
    for name, model in models.items():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            model(**batch).loss
        scores[name] = saved.count(torch.Size([3, 4, 16, 16]))
    assert scores == {"eager": 2, "2022": 4}  # a layer's softmax output; in 2022 its input too

def test_litgpts_lora_models_train_the_parameters_its_resource_table_counts():
    counts = {}
    for name, trained in (("phi-1_5", 1_572_864), ("stablelm-base-alpha-3b", 2_097_152), ("Llama-2-7b-hf", 4_194_304)):
        with torch.device("meta"):
            model = litgpt_lora(name)
        counts[name] = sum(p.numel() for p in model.parameters() if p.requires_grad), trained
    assert all(ours == table for ours, table in counts.values()), counts
    with torch.device("meta"):
        llama = litgpt_lora("Llama-2-7b-hf")
    assert sum(p.numel() for p in llama.parameters() if not p.requires_grad) == 6_738_415_616  # Llama 2 7B


def test_litgpts_lora_updates_the_query_and_value_only_and_its_step_holds_the_float32_logits():
    torch.manual_seed(0)
    model = litgpt_lora("Llama-2-7b-hf", seq=300, n_layer=1, n_embd=64, n_head=4, intermediate_size=96,
                        padded_vocab_size=100, dropout=0.0)
    qkv = model.transformer.h[0].attn.attn
    torch.nn.init.normal_(qkv.lora_B)
    x = torch.randn(2, 5, 64)
    update = qkv(x) - qkv.linear(x)
    assert update[..., :64].abs().min() > 0 and update[..., 64:128].abs().max() == 0 and update[..., 128:].abs().min() > 0
    loss = litgpt_step(model, model.example_batch(2))
    held = model._litgpt_logits  # the script's logits, alive through its backward
    assert [c.shape[1] for c in held] == [128, 128, 43] and all(c.dtype == torch.float32 for c in held)
    loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == {
        "transformer.h.0.attn.attn.lora_A", "transformer.h.0.attn.attn.lora_B"}


def test_a_row_that_ran_out_is_predicted_out_of_memory_and_merge_keeps_the_other_rows(tmp_path):
    args = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", json.dumps(TINY), "--device", "cuda",
            "--budget", "{}", "--precisions", "fp32", "--segments", "0", "--batch-sizes", "4"]
    small = [a.replace("{}", "1GiB") for a in args]
    tiny = [a.replace("{}", "1MiB") for a in args]
    rows = [_row("fits", small), _row("ran-out", tiny, published=None, ran_out=True)]
    done = _run(tmp_path, rows)
    assert done.returncode == 0, done.stderr
    fits, ran_out = json.loads((tmp_path / "out" / "published-cpu.json").read_text())["rows"]
    assert ran_out["published_status"] == ran_out["status"] == "oom" and ran_out["error"] is None
    assert fits["published_status"] == fits["status"] == "ok"
    md = (tmp_path / "out" / "published-cpu.md").read_text()
    assert "| OOM | OOM (needs " in md and "| agrees |" in md and "1 is predicted to" in md
    edited = [{**rows[0], "config": "changed"}, rows[1]]  # rerun one row; the other's result is the file's
    done = _run(tmp_path, edited, "--only", "fits", "--merge")
    assert done.returncode == 0, done.stderr
    again = json.loads((tmp_path / "out" / "published-cpu.json").read_text())["rows"]
    assert [r["id"] for r in again] == ["fits", "ran-out"] and again[0]["config"] == "changed"
    assert again[1] == ran_out
    for extra, says in ((["--merge"], "give --only"), (["--only", "fits", "--merge", "--out", str(tmp_path)],
                                                        "cannot read")):
        done = _run(tmp_path, rows, *extra)
        assert done.returncode == 2 and says in done.stderr, done.stderr
    assert _run(tmp_path, [_row("r", None, published=None, ran_out=True, why_not="x")]).returncode == 2
