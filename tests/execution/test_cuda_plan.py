"""Planning for CUDA on a machine without a GPU (``--device cuda --dry-run``): CUDA's autocast lists on the CPU's
fake tensors, reserved bytes from the allocator's model, which the budget holds; NVML's figure with the context.

What only a GPU can say (how close these predictions come to a measurement) is benchmarks/gpu_check.py's section 6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autotune
from autotune.__main__ import main
from autotune.execution.cuda_rules import CUDA_POLICIES, CudaFindings, CudaRules, cuda_autocast_on_cpu
from autotune.execution.predict import fake_tensors, predict_trial
from autotune.meters.caching_allocator import CUDA_CONTEXT_BYTES, cublas_workspace_bytes
from autotune.records import Config
from autotune.training.workload import Workload

from tests.optional import needs

TINY = {"n_layer": 2, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}
MiB = 1 << 20


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a CPU-only machine says, on any machine


def _dtypes() -> dict[str, torch.dtype]:
    """What autocast makes of some ops' outputs, on fake tensors (the CPU has no bf16 kernel for every op)."""
    with fake_tensors():
        normed, lstm = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(8, 8)), torch.nn.LSTM(8, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = torch.randn(4, 8, requires_grad=True)
            h = torch.nn.Linear(8, 8)(x)
            return {"linear": h.dtype, "layer_norm": F.layer_norm(h, (8,)).dtype, "softmax": F.softmax(h, -1).dtype,
                    "exp": h.exp().dtype, "sum": h.sum().dtype, "mse_loss": F.mse_loss(h, h.detach()).dtype,
                    "cat": torch.cat([h, h]).dtype, "pool3d": F.avg_pool3d(h.view(1, 1, 4, 2, 4), 2).dtype,
                    # norm's overloads without a dtype, their defaults left out: CUDA redispatches with float32
                    "weight_norm": normed(x).dtype, "norm": torch.norm(h).dtype,
                    "norm_dim": torch.ops.aten.norm.ScalarOpt_dim(h, 2, [1]).dtype, "sum_f64": h.double().sum().dtype,
                    "lstm": lstm(h.view(4, 1, 8))[0].dtype}  # cast in _cudnn_rnn on CUDA, a CUDA build's only


def test_cudas_autocast_lists_replace_the_cpus_inside_the_block_and_only_there():
    cpu = _dtypes()
    with cuda_autocast_on_cpu() as unknown:
        cuda = _dtypes()
        with pytest.raises(RuntimeError, match="unsafe to autocast"), torch.autocast("cpu", dtype=torch.bfloat16):
            F.binary_cross_entropy(torch.rand(3), torch.rand(3))  # CUDA's autocast refuses it; the CPU's runs it
    assert unknown == []  # every op this torch casts on CUDA has a known policy
    assert cpu == {**_dtypes()}  # put back after the block
    # casting down where both do; float32 where CUDA's lists say so and the CPU's do not; the CPU's own casts gone
    assert cuda == {"linear": torch.bfloat16, "layer_norm": torch.float32, "softmax": torch.float32,
                    "exp": torch.float32, "sum": torch.float32, "mse_loss": torch.float32, "cat": torch.bfloat16,
                    "pool3d": torch.bfloat16, "weight_norm": torch.bfloat16, "norm": torch.float32,
                    "norm_dim": torch.float32, "sum_f64": torch.float64, "lstm": torch.bfloat16}
    assert cpu["layer_norm"] == cpu["softmax"] == torch.bfloat16 and cpu["pool3d"] == torch.float32
    assert set(CUDA_POLICIES.values()) == {"lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote",
                                           "banned"}


def test_a_cuda_prediction_reads_reserved_bytes_and_the_budget_holds_them(no_gpu):
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY)
    rules = CudaRules.for_this_machine()
    assert rules.here == torch.device("cpu")
    workspaces = 2 * cublas_workspace_bytes(*rules.capability)
    fp32 = Config("fp32", "0", 8)
    cpu, cuda = predict_trial(workload, fp32), predict_trial(workload, fp32, cuda=rules)
    # fp32 has no autocast: the same tensors, each rounded to 512 bytes, after two cuBLAS workspaces
    assert cpu.peak_bytes + workspaces <= cuda.peak_allocated_bytes <= cpu.peak_bytes + workspaces + 512 * 400
    assert cuda.peak_bytes == cuda.peak_reserved_bytes >= cuda.peak_allocated_bytes
    assert cuda.peak_reserved_bytes % (2 * MiB) == 0  # whole segments
    assert cuda.peak_nvml_bytes == cuda.peak_reserved_bytes + CUDA_CONTEXT_BYTES
    assert cuda.memory_source == "predicted"

    # bf16: CUDA's autocast keeps the softmax's attention scores in float32, the CPU's in bf16
    bf16 = Config("bf16", "0", 8)
    cpu16, cuda16 = predict_trial(workload, bf16), predict_trial(workload, bf16, cuda=rules)
    assert cuda16.peak_allocated_bytes - workspaces > cpu16.peak_bytes * 1.1

    # a budget the tensors fit but the allocator's segments do not: out of memory, as on CUDA, said to be predicted
    budget = cuda.peak_allocated_bytes + 1
    tight = predict_trial(workload, fp32, budget_bytes=budget, cuda=rules)
    assert predict_trial(workload, fp32, budget_bytes=budget - workspaces).status == "ok"
    assert tight.status == "oom" and "predicted" in tight.error and "caching allocator" in tight.error
    assert tight.peak_bytes > budget and tight.oom_needed_bytes > budget


def test_the_cli_plans_cuda_without_a_gpu(no_gpu, tmp_path, capsys):
    argv = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", '{"n_layer": 2, "n_embd": 32, "n_head": 4}',
            "--device", "cuda", "--dry-run", "--quiet", "--out", str(tmp_path / "r.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budget" in err[0] and "without a GPU" in err[0]

    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, device="cuda", dry_run=True,
                           budget="80MiB", precisions=["bf16"], segments=["0"], batch_sizes=[8, 64, 512])
    assert report.environment["device_type"] == "cuda" and "planned" in report.environment["device_name"]
    assert report.search["batch_multiple"] == 8 and report.search["cuda"]["predicted_on"].startswith("fake CPU")
    assert any("CUDA's autocast op lists" in n for n in report.notices)
    assert all(t.peak_bytes == t.peak_reserved_bytes for t in report.trials if t.status == "ok")
    (limit,) = report.limits
    assert limit["max_batch_size"] % 8 == 0 and limit["exact"] and limit["min_oom_batch_size"] == limit["max_batch_size"] + 8
    assert {t.batch_size for t in report.trials} >= {limit["max_batch_size"], limit["max_batch_size"] + 8}


def test_a_model_fake_tensors_cannot_run_is_not_measured_on_the_cpu_for_a_cuda_plan(no_gpu):
    from tests.test_dry_run import Masked  # selects by value: aten.nonzero

    # the CPU's measurement is not CUDA's: one line naming the op, where a CPU plan would measure it for real
    with pytest.raises(autotune.UsageError, match=r"Masked cannot run under fake tensors \(aten.nonzero.*for cuda:0"):
        autotune.tune(Masked, device="cuda", dry_run=True, budget="1GiB", precisions=["fp32"], segments=["0"],
                      batch_sizes=[4])


def _qkv(dtype=torch.bfloat16, heads=(8, 8), length=(64, 64), head=64):
    q = torch.randn(2, heads[0], length[0], head, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, heads[1], length[1], head, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("case, capability, expected", [
    ({}, (9, 0), "flash"),
    ({"dtype": torch.float32}, (9, 0), "efficient"),  # flash takes fp16 and bf16 only
    ({"mask": True}, (9, 0), "efficient"),  # flash takes no mask
    ({"mask": True, "head": 60}, (9, 0), "math"),  # bf16's GEMM alignment is 8
    ({"dtype": torch.float32, "head": 62}, (9, 0), "math"),  # fp32's is 4 on sm80+
    ({}, (7, 0), "math"),  # flash needs sm80, and a V100's memory-efficient kernel no bf16
    ({"dtype": torch.float16}, (7, 0), "efficient"),
    ({"head": 200}, (8, 6), "efficient"),  # training with a head of 192-224 on sm86: not flash
    ({"head": 200}, (8, 0), "flash"),
    ({"causal_lengths": (32, 64)}, (9, 0), "efficient"),  # flash's causal mask is square only
    ({"gqa": True}, (9, 0), "flash"),
    ({"gqa_off": True}, (9, 0), "math"),  # heads differ without enable_gqa
])
def test_the_attention_kernel_is_chosen_by_cudas_rules(case, capability, expected):
    from autotune.execution.cuda_attention import choose

    heads = (8, 2) if case.get("gqa") or case.get("gqa_off") else (8, 8)
    lengths = case.get("causal_lengths", (64, 64))
    with fake_tensors():
        q, k, v = _qkv(case.get("dtype", torch.bfloat16), heads, lengths, case.get("head", 64))
        mask = torch.ones(2, 1, 64, 64, dtype=torch.bool) if case.get("mask") else None
        assert choose(q, k, v, mask, 0.0, mask is None, bool(case.get("gqa")), capability) == expected


def test_a_cuda_plan_runs_the_attention_kernel_cuda_would_and_keeps_what_it_keeps(no_gpu):
    """A transformers Llama's SDPA attention, no token padded (the mask skipped, as the real step skips it): flash in
    bf16, memory-efficient in fp32; the CPU's own kernel is back after the prediction."""
    needs("transformers")
    llama = {"model_type": "llama", "seq_len": 32, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    workload = Workload.from_specs("autotune.thirdparty:hf_causal_lm", model_kwargs=llama)
    for precision, kernel in (("bf16", "flash"), ("fp32", "efficient")):
        rules, findings = CudaRules.for_this_machine(), CudaFindings()
        predicted = predict_trial(workload, Config(precision, "0", 8), cuda=rules, findings=findings)
        assert predicted.status == "ok", predicted.error
        assert rules.describe(findings)["attention"] == {kernel: 2}, rules.describe(findings)
        assert any(f"{kernel} 2" in n for n in rules.notices(findings))
    with fake_tensors():
        q, k, v = _qkv(torch.float32)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"


def test_a_cuda_plan_steps_torch_optim_as_cuda_does(no_gpu):
    """Left to its default, AdamW steps with foreach on CUDA: its intermediates for every parameter at once (the
    square roots of the second moments, the parameters' size) where the loop over tensors made one at a time."""
    from autotune.execution.cuda_rules import optimizers_as_on_cuda

    wide = {**TINY, "n_embd": 128}
    sizes = [p.numel() * 4 for p in Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=wide)
             .build_model().parameters()]
    peaks = {}
    for foreach in (None, False):
        workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=wide,
                                       optimizer="torch.optim:AdamW", optimizer_kwargs={"foreach": foreach})
        peaks[foreach] = predict_trial(workload, Config("fp32", "0", 1), cuda=CudaRules.for_this_machine())
    # the loop holds about two intermediates of one parameter at a time (a square root, then its quotient): the
    # largest here is a sixth of the parameters
    assert peaks[None].peak_allocated_bytes >= peaks[False].peak_allocated_bytes + 0.5 * sum(sizes)
    from torch.optim.optimizer import _default_to_fused_or_foreach

    with optimizers_as_on_cuda():
        pass
    with fake_tensors():
        assert _default_to_fused_or_foreach([torch.nn.Linear(2, 2).weight], False) == (False, False)  # put back


def _dropout_backward(p: float = 0.1, training: bool = True) -> str:
    with fake_tensors():
        out = F.dropout(torch.randn(64, 64, requires_grad=True), p, training=training)
        return type(out.grad_fn).__name__


def test_a_cuda_plan_keeps_dropouts_bool_mask_as_cuda_does(no_gpu):
    """CUDA's dropout is the fused native_dropout, keeping a bool mask (one byte an element); the CPU's multiplies by a
    noise tensor of the input's dtype and keeps it (four bytes in float32)."""
    from autotune.execution.cuda_rules import dropout_as_on_cuda

    assert _dropout_backward() == "MulBackward0"
    with dropout_as_on_cuda():
        assert _dropout_backward() == "NativeDropoutBackward0"
        assert _dropout_backward(p=0.0) == _dropout_backward(training=False) == "NoneType"  # the input itself
        assert _dropout_backward(p=1.0) == "MulBackward0"  # zeros, as on every device
    assert _dropout_backward() == "MulBackward0"  # put back

    # TinyGPT with dropout on the attention scores and after each block's sublayers: CUDA's masks are a quarter of
    # the CPU's noise, so the prediction holds 3 bytes less for each element dropped out and kept for backward
    kwargs = {**TINY, "dropout": 0.1}
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=kwargs)
    rules = CudaRules.for_this_machine()
    config = Config("fp32", "0", 8)
    cpu, cuda = predict_trial(workload, config), predict_trial(workload, config, cuda=rules)
    workspaces = 2 * cublas_workspace_bytes(*rules.capability)
    batch, seq, width, heads = 8, kwargs["block_size"], kwargs["n_embd"], kwargs["n_head"]
    masks = kwargs["n_layer"] * (heads * seq * seq + 2 * seq * width) + seq * width  # scores, two sublayers, embedding
    assert cuda.peak_allocated_bytes - workspaces <= cpu.peak_bytes - 3 * batch * masks + 512 * 400


def test_the_planned_gpu_is_described_by_its_capability_and_context(no_gpu, tmp_path, capsys):
    space = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", '{"n_layer": 2, "n_embd": 32, "n_head": 4}',
             "--device", "cuda", "--budget", "1GiB", "--segments", "0", "--batch-sizes", "8", "--dry-run", "--quiet"]
    for bad, says in ((["--cuda-capability", "8"], "MAJOR.MINOR"), (["--cuda-capability", "nine"], "MAJOR.MINOR"),
                      (["--cuda-context", "lots"], "lots"), (["--precisions", "bf16", "--cuda-capability", "7.0"],
                                                             "bf16 is not supported")):
        assert main([*space, *bad, "--out", str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert main([*space[:-2], "--cuda-context", "1GiB", "--quiet", "--out", str(tmp_path / "cpu.json")]) == 2
    assert "--device cuda --dry-run" in capsys.readouterr().err  # --cuda-* describe a planned GPU only
    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, device="cuda", dry_run=True,
                           budget="1GiB", precisions=["fp16"], segments=["0"], batch_sizes=[8],
                           cuda_capability="7.0", cuda_context="1343MiB")
    cuda = report.search["cuda"]
    assert cuda["compute_capability"] == "7.0" and cuda["compute_capability_source"] == "given"
    assert cuda["context_bytes"] == 1343 * MiB and cuda["context_source"] == "given"
    assert cuda["cublas_workspace_bytes"] == cublas_workspace_bytes(7, 0)
    (trial,) = report.trials
    assert trial.peak_nvml_bytes == trial.peak_reserved_bytes + 1343 * MiB
    assert "7.0" in report.environment["device_name"]
    assert not any("assumed: --cuda" in n for n in report.notices)


def test_a_cuda_plan_counts_the_weights_from_their_move_not_the_hosts_build(no_gpu):
    """A GPU's trial builds the model in host memory and casts it there: the device holds bf16-true's weights in bf16
    only. On the CPU both are one memory (the float32 build counts); a CUDA plan made here counts what the move
    would put on the GPU."""
    workload = Workload.from_specs("tests.models:FrozenWide")
    weights = sum(p.numel() for p in workload.build_model().parameters())  # float32 at build, 1,050,625 of them
    rules = CudaRules.for_this_machine()
    workspaces = 2 * cublas_workspace_bytes(*rules.capability)
    true, fp32 = Config("bf16-true", "0", 4), Config("fp32", "0", 4)
    on_gpu = predict_trial(workload, true, cuda=rules).peak_allocated_bytes - workspaces
    assert 2 * weights <= on_gpu < 2 * weights * 1.05  # the bf16 weights, a small step's tensors beside them
    assert predict_trial(workload, true).peak_bytes >= 4 * weights  # the CPU's: the float32 build counts there
    assert predict_trial(workload, fp32, cuda=rules).peak_allocated_bytes - workspaces >= 4 * weights


