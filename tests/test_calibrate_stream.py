"""Layer-streamed calibration (``calibrate --runner stream``, trtmoe/quant/stream.py): the same
measurement as the whole-model engine path on the trained fixtures, and any transformers MoE, checked
against a whole-model transformers run of the same model."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from trtmoe.data import load_texts, write_split_text
from trtmoe.errors import InputError, UnsupportedError
from trtmoe.quant.calibrate import calibrate, token_batches
from trtmoe.quant.policies import make_plan
from trtmoe.quant.stream import StreamedModel, adapt_seams, find_experts
from trtmoe.runtime.load import load_tokenizer

from test_quant_pipeline import cli, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("txt") / "calib.txt"
    write_split_text("calib", p, max_bytes=12_000)
    return p


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("fixture,rounding", [("trained_mixtral", "awq_gptq"), ("trained_qwen3_moe", "rtn")])
def test_streamed_calibration_equals_the_whole_model_path_on_the_trained_fixtures(fixture, rounding, text):
    model = FIXTURES / fixture
    if not (model / "config.json").is_file():
        pytest.skip(f"tests/fixtures/{fixture} is missing (scripts/make_trained_fixture.py)")
    kw = dict(samples=4, seq_len=32, formats=("int8", "int4_g128", "int4"), rounding=rounding, batch_size=2)
    engine = calibrate(model, text, None, runner="engine", **kw)
    notes: list[str] = []
    stream = calibrate(model, text, None, runner="stream", notes=notes, **kw)
    assert any("layer-streamed calibration" in n and "GiB" in n for n in notes)
    assert stream["sensitivity"]["runner"] == "stream"
    assert stream["routing"]["counts"] == engine["routing"]["counts"]
    assert _rel(engine["routing"]["weight_mass"], stream["routing"]["weight_mass"]) < 1e-5
    assert _rel(engine["routing"]["entropy_nats"], stream["routing"]["entropy_nats"]) < 1e-5
    for f in engine["formats"]:
        # The activation-aware searches pick from discrete candidates by the smallest error, so
        # activations equal to float rounding may tip a near tie (one matrix's scale or clip): those
        # formats agree to a few percent, round-to-nearest ones to float rounding.
        tol = 5e-2 if rounding != "rtn" and f.startswith("int4") else 1e-3
        for m in ("fc", "proj"):
            assert _rel(engine["sensitivity"]["matrices"][m]["delta_kl"][f],
                        stream["sensitivity"]["matrices"][m]["delta_kl"][f]) < tol, (f, m)
    for budget in (4.6, 6.0):
        a = make_plan(engine, "graded", budget_bpw=budget, granularity="matrix", dtype=torch.bfloat16)
        b = make_plan(stream, "graded", budget_bpw=budget, granularity="matrix", dtype=torch.bfloat16)
        if rounding == "rtn":
            assert (a.formats, a.proj_formats) == (b.formats, b.proj_formats), budget
        else:  # a near tie the searches tipped may move one or two matrices at the budget's edge
            cells = [(l, e, m) for l in a.formats for e in range(len(a.formats[l])) for m in (0, 1)]
            pick = lambda p, l, e, m: (p.formats if m == 0 else p.proj_formats)[l][e]  # noqa: E731
            moved = sum(pick(a, *c) != pick(b, *c) for c in cells)
            assert moved <= 2, (budget, moved, len(cells))
            assert abs(a.meta["predicted_delta_kl"] / b.meta["predicted_delta_kl"] - 1) < 0.02
    cost = stream["cost"]
    assert {"boundaries", "forward", "backward", "scoring", "io"} <= set(cost["phases"])
    if rounding != "rtn":
        assert {"statistics", "searches"} <= set(cost["phases"])
    # The ratio is to the run's own layer-streamed forward, which is part of its total.
    assert cost["forward"]["in_total"] and cost["ratio_to_forward"] > 1.0
    assert "cost_seconds" not in stream["sensitivity"] and "cost_forward_passes" not in stream["sensitivity"]


def _tiny(tiny_model, arch, tokdir, root: Path, **kwargs) -> Path:
    model = Path(shutil.copytree(tiny_model(arch, seed=3, **kwargs), root / arch))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokdir / f, model / f)
    return model


BF16_STORED = ("inkling_text", "glm_moe_dsa", "deepseek_v4", "gemma4_text", "dots3_note_text", "laguna")


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "gpt_oss", "olmoe", "glm4_moe", "llama4_text",
                                  "qwen3_moe", "granitemoe", "dots1", "flex_olmo", "exaone_moe", "afmoe", "cohere2_moe",
                                  "jamba", "lfm2_moe", "inkling_text", "glm_moe_dsa", "deepseek_v4", "gemma4_text",
                                  "dots3_note_text", "laguna"])
def test_any_transformers_moe_calibrates_layer_streamed(arch, tiny_model, tokdir, text, tmp_path):
    import transformers

    # Stored in bfloat16, as released checkpoints are (Inkling's embedding normalises its rows: computed in
    # the storage dtype, the streamed logits were 30 % off).
    model = _tiny(tiny_model, arch, tokdir, tmp_path, **({"dtype": "bfloat16"} if arch in BF16_STORED else {}))
    samples, seq_len = 4, 24
    tok = load_tokenizer(tokdir)
    tok.add_bos = True
    ids = token_batches(load_texts(text), tok, samples, seq_len)
    # The whole model, as transformers runs it, with the routed experts counted at the experts seam.
    full = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = full(ids).logits
    # Llama-4's experts take every token with router-scaled inputs: the seam is given to them (the
    # adapted model must compute the same logits as transformers' own, checked here) before counting.
    if adapt_seams(full):
        with torch.no_grad():
            assert float((full(ids).logits - ref).abs().max()) < 1e-5 * float(ref.abs().max())
    E = None
    counts: dict[int, torch.Tensor] = {}
    for i, lay in enumerate(full.model.layers):
        found = find_experts(lay)
        if found:
            E = found[0].gate_up_proj.shape[0]
            found[0].register_forward_pre_hook(
                lambda m, a, i=i: counts.__setitem__(i, counts.get(i, 0) + torch.bincount(a[1].reshape(-1), minlength=E)))
    with torch.no_grad():
        full(ids)
    got = StreamedModel(model).logits(ids, batch_size=3)
    assert float((got - ref).abs().max()) < 1e-4 * float(ref.abs().max())

    rounding = "awq_gptq"
    out = tmp_path / "calib"
    engine_arch = arch == "qwen3_moe"  # auto picks the engine where it implements the architecture
    res = calibrate(model, text, out, samples=samples, seq_len=seq_len, formats=("int8", "int4"),
                    rounding=rounding, batch_size=2, runner="stream" if engine_arch else "auto")
    assert res["sensitivity"]["runner"] == "stream"
    moe = sorted(counts)
    assert res["moe_layers"] == moe
    for l in moe:
        assert res["routing"]["counts"][l] == counts[l].tolist()
    for f in res["formats"]:
        d = torch.tensor(res["sensitivity"]["delta_kl"][f])[moe]
        assert bool((d > 0).all()), f
    # Coarser formats cost more ΔKL (summed over the model).
    tot = {f: sum(map(sum, res["sensitivity"]["delta_kl"][f])) for f in res["formats"]}
    assert tot["int8"] < tot["int4"]
    assert (out / "calib.json").is_file() and (out / "manifest.json").is_file()
    plan = make_plan(json.loads((out / "calib.json").read_text()), "graded", budget_bpw=6.0, granularity="matrix",
                     dtype=torch.float32)
    assert sorted(plan.formats) == moe
    if engine_arch:
        return
    # The embedded engine and the TensorRT-LLM 1.2 writer do not implement this architecture: refused by name.
    r = cli("convert", model, "-o", tmp_path / "ck", "--calib", out, "--budget", "6", expect=None)
    assert r.exit_code != 0 and "not supported" in r.output and "Traceback" not in r.output


def test_streamed_runner_refusals(tiny_model, tokdir, text, tmp_path):
    model = _tiny(tiny_model, "gpt_oss", tokdir, tmp_path)
    with pytest.raises(InputError, match="fisher"):
        calibrate(model, text, None, samples=2, seq_len=16, sensitivity="exact")
    with pytest.raises(InputError, match="unknown runner"):
        calibrate(model, text, None, samples=2, seq_len=16, runner="fast")
    # Llama-4's router scales the expert's input: exact at the seam only with one expert per token.
    two = tiny_model("llama4_text", num_experts_per_tok=2)
    with pytest.raises(InputError, match="one expert per token only"):
        StreamedModel(two)


def test_encoder_decoder_and_multimodal_wrappers_are_refused_in_one_line(tmp_path, text, tokdir):
    """Out of scope: encoder-decoder MoEs (Switch Transformers) and multimodal wrappers (Qwen3-VL-MoE): calibrate
    and inspect say so in one line, without a traceback."""
    import transformers
    from safetensors.torch import save_file

    configs = {
        "switch_transformers": transformers.SwitchTransformersConfig(
            vocab_size=250, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
            num_experts=4, architectures=["SwitchTransformersForConditionalGeneration"]),
        "qwen3_vl_moe": transformers.Qwen3VLMoeConfig(
            text_config=dict(vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_experts=4, num_experts_per_tok=2),
            architectures=["Qwen3VLMoeForConditionalGeneration"]),
    }
    said = {"switch_transformers": "(an encoder-decoder model): decoder-only causal language models only",
            "qwen3_vl_moe": "(a multimodal wrapper around its text model): decoder-only causal language models only"}
    for name, cfg in configs.items():
        d = tmp_path / name
        cfg.save_pretrained(d)
        save_file({"x": torch.zeros(1, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
        r = cli("calibrate", d, "--data", text, "-o", tmp_path / f"c-{name}", "--runner", "stream", "--samples", "2",
                "--seq-len", "16", "--tokenizer", tokdir, expect=2)
        assert f"transformers has no causal-LM class for model_type {name!r} {said[name]}" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
        r = cli("inspect", d, expect=2)
        line = " ".join(r.output.split())
        assert "Traceback" not in r.output and ("encoder-decoder" in line if name == "switch_transformers"
                                                else said[name] in line), line


def test_a_multimodal_wrapper_in_the_causal_lm_mapping_is_named_a_wrapper(tmp_path, text, tokdir):
    """Gemma-4's multimodal class is what AutoModelForCausalLM builds for its config, and its decoder layers are
    not at model.layers: calibrate and inspect say it is a multimodal wrapper around its text model (which
    calibrates: gemma4_text above), in one line."""
    import transformers
    from make_tiny_models import DEFAULT_CONFIGS
    from safetensors.torch import save_file

    d = tmp_path / "gemma4"
    transformers.Gemma4Config(text_config=dict(DEFAULT_CONFIGS["gemma4_text"]),
                              architectures=["Gemma4ForConditionalGeneration"]).save_pretrained(d)
    save_file({"x": torch.zeros(1, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
    said = "Gemma4ForConditionalGeneration is a multimodal wrapper around its text model (model_type 'gemma4_text')"
    r = cli("calibrate", d, "--data", text, "-o", tmp_path / "c", "--runner", "stream", "--samples", "2",
            "--seq-len", "16", "--tokenizer", tokdir, expect=2)
    assert said in " ".join(r.output.split()) and len(r.output.strip().splitlines()) == 1, r.output
    r = cli("inspect", d, expect=2)
    assert said in " ".join(r.output.split()) and "Traceback" not in r.output, r.output


def test_models_whose_layers_or_experts_are_off_the_seam_are_refused_in_one_line(tmp_path, text, tokdir):
    """DBRX keeps its layers at transformer.blocks (experts as flattened w1/v1/w2), JetMoE its experts as
    input_linear / output_linear modules: the runner reads neither, and says so in one line naming the class."""
    import transformers

    models = {
        "dbrx": (transformers.DbrxForCausalLM, transformers.DbrxConfig(
            vocab_size=250, d_model=64, n_heads=4, n_layers=2, attn_config={"kv_n_heads": 2, "rope_theta": 1e4},
            ffn_config={"hidden_size": 64, "ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2})),
        "jetmoe": (transformers.JetMoeForCausalLM, transformers.JetMoeConfig(
            vocab_size=250, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    }
    said = {"dbrx": "DbrxForCausalLM: the layer-streamed runner reads the decoder layers at model.layers",
            "jetmoe": "JetMoeForCausalLM has no routed-experts module at transformers' experts seam"}
    for name, (cls, cfg) in models.items():
        d = tmp_path / name
        cls(cfg).save_pretrained(d)
        r = cli("calibrate", d, "--data", text, "-o", tmp_path / f"c-{name}", "--runner", "stream", "--samples", "2",
                "--seq-len", "16", "--tokenizer", tokdir, expect=2)
        assert said[name] in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / f"c-{name}").exists()


@pytest.mark.parametrize("arch,said", [
    ("inkling2_text", "Inkling2ForCausalLM: the model's own forward forms the logits from earlier layers' outputs "
                      "besides the last one; the layer-streamed runner cannot"),
    ("nemotron_h", "NemotronHExperts: experts without a gate projection are not supported by calibration"),
])
def test_models_the_streamed_runner_cannot_measure_are_refused_in_one_line(arch, said, tiny_model, tokdir, text,
                                                                            tmp_path):
    """Inkling-2's logits mix every layer's output (block residuals): run one layer at a time with the others
    stood in for, they would be measured wrong without a word, so the runner checks that a layer's recorded
    inputs and the logits depend on no stand-in's output but the last one's. Nemotron-H's experts have no
    gate projection (calibration scores gated experts). Both: one line, exit 2, nothing written; inspect
    still reads them."""
    model = _tiny(tiny_model, arch, tokdir, tmp_path)
    r = cli("calibrate", model, "--data", text, "-o", tmp_path / "c", "--runner", "stream", "--samples", "2",
            "--seq-len", "16", expect=2)
    assert said in " ".join(r.output.split()) and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "c").exists()
    assert "experts" in cli("inspect", model).output


def test_a_failure_of_the_models_own_loop_around_the_stand_ins_is_not_blamed_on_transformers(tiny_model, tokdir,
                                                                                             text, tmp_path,
                                                                                             monkeypatch):
    """An error raised inside transformers while the model's own forward runs on the runner's stand-ins
    (recording the layers' calls) is the runner's limit, said in one line as such (exit 2), not "transformers'
    own modelling code failed"."""
    from transformers.models.olmoe import modeling_olmoe

    model = tiny_model("olmoe", seed=4)
    real = modeling_olmoe.OlmoeModel.forward

    def wants_more(self, *a, **kw):  # a loop that reads something of a layer's output the stand-ins lack
        out = real(self, *a, **kw)
        if not self.training:
            raise ValueError("too many values to unpack (expected 2)")
        return out

    monkeypatch.setattr(modeling_olmoe.OlmoeModel, "forward", wants_more)
    r = cli("calibrate", model, "--data", text, "-o", tmp_path / "c", "--runner", "stream", "--samples", "2",
            "--seq-len", "16", "--tokenizer", tokdir, expect=2)
    line = " ".join(r.output.split())
    assert "OlmoeForCausalLM's own forward failed with its decoder layers stood in for by the layer-streamed " \
           "runner" in line and "too many values to unpack" in line, line
    assert "transformers' own modelling code" not in line and len(r.output.strip().splitlines()) == 1


def test_a_failure_inside_transformers_modelling_code_is_one_line_naming_it(tiny_model, text, tokdir, tmp_path,
                                                                               monkeypatch):
    """The streamed runner runs transformers' own decoder layers: an error raised there (a configuration the
    model's code cannot run) is one line naming transformers' file and function, exit code 2, not a trtmoe
    internal error; the same error raised by trtmoe's own code stays an internal error."""
    from transformers.models.olmoe import modeling_olmoe

    model = tiny_model("olmoe", seed=4)
    real = modeling_olmoe.apply_rotary_pos_emb

    def mismatched(q, k, cos, sin, *a, **kw):  # what a config the rotary code cannot take meets
        return real(q, k, cos[..., :1], sin[..., :3], *a, **kw)

    monkeypatch.setattr(modeling_olmoe, "apply_rotary_pos_emb", mismatched)
    r = cli("calibrate", model, "--data", text, "-o", tmp_path / "c", "--runner", "stream", "--samples", "2",
            "--seq-len", "16", "--tokenizer", tokdir, expect=2)
    line = " ".join(r.output.split())
    assert re.search(r"error: transformers' own modelling code failed on this model \(transformers/models/olmoe/"
                     r"modeling_olmoe\.py:\d+ in apply_rotary_pos_emb\): RuntimeError: ", line), line
    assert "internal error" not in line and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "c").exists()

    def ours(*a, **kw):
        raise RuntimeError("a trtmoe bug")
    monkeypatch.setattr(modeling_olmoe, "apply_rotary_pos_emb", real)
    monkeypatch.setattr("trtmoe.quant.stream.find_experts", ours)
    r = cli("calibrate", model, "--data", text, "-o", tmp_path / "d", "--runner", "stream", "--samples", "2",
            "--seq-len", "16", "--tokenizer", tokdir, expect=1)
    assert "internal error: RuntimeError: a trtmoe bug (a bug in trtmoe" in " ".join(r.output.split()), r.output


class _Stop(Exception):
    pass


# Stopped during the forward pass; after the top layer's backward. GLM-MoE-DSA's layers hand the next one their
# indexer's top-k besides the hidden state, which no saved layer input holds: a resumed run recomputes it.
@pytest.mark.parametrize("arch,stop_at", [("olmoe", 1), ("olmoe", 5), ("glm_moe_dsa", 2), ("glm_moe_dsa", 5)])
def test_streamed_calibration_resumes_per_layer(arch, stop_at, tiny_model, tokdir, text, tmp_path):
    from trtmoe.quant.stream import stream_measure

    model = tiny_model(arch, seed=4)  # 3 layers: steps 1-3 forward, 4 the top, 5-7 backward
    tok = load_tokenizer(tokdir)
    ids = token_batches(load_texts(text), tok, 4, 16)
    kw = dict(formats=("int8", "int4"), batch_size=2, key="k", min_tokens=4)
    whole = stream_measure(StreamedModel(model), ids, work=tmp_path / "a", **kw)

    def stop(what, step, total):
        if step == stop_at:
            raise _Stop

    with pytest.raises(_Stop):
        stream_measure(StreamedModel(model), ids, work=tmp_path / "b", progress=stop, **kw)
    notes: list[str] = []
    sm = StreamedModel(model)
    resumed = stream_measure(sm, ids, work=tmp_path / "b", notes=notes, **kw)
    assert sm.carries_outputs == (arch == "glm_moe_dsa")
    if stop_at > 4:
        assert any("resumed" in n for n in notes)
    assert resumed["routing"]["counts"] == whole["routing"]["counts"]
    assert resumed["sensitivity"]["delta_kl"] == whole["sensitivity"]["delta_kl"]
    # Progress of another calibration (another key) is not resumed from.
    other = stream_measure(StreamedModel(model), ids, work=tmp_path / "b", notes=notes, **{**kw, "key": "other"})
    assert other["sensitivity"]["delta_kl"] == whole["sensitivity"]["delta_kl"]


def test_memory_statement_counts_the_layer_outputs_carried_to_later_layers(tiny_model, tokdir, text):
    from trtmoe.quant import stream

    ids = token_batches(load_texts(text), load_tokenizer(tokdir), 4, 16)
    sm = StreamedModel(tiny_model("glm_moe_dsa", seed=4))
    per_token = sm.carried_bytes_per_token(ids)
    # What running every layer over every batch holds: the indexer top-k each layer hands on.
    held = 0
    for b in ids.split(2):
        x, calls = sm.boundaries(b)
        carries, needed = {}, stream.carried(calls)
        for i in range(len(sm.meta_layers)):
            with sm.layer(i) as lay, torch.no_grad():
                x = stream.run_layer(lay, i, x, calls[i], carries, needed)
        held += sum(v.nbytes for v in carries.values())
    assert needed and held > 0
    assert per_token * ids.numel() == held
    plan = stream.memory_plan(sm, ids.numel(), 32, 16, carried_per_token=per_token)
    assert plan["parts"]["carried_outputs"] == held
    plain = StreamedModel(tiny_model("olmoe", seed=4))
    assert plain.carried_bytes_per_token(ids) == 0
    assert "carried_outputs" not in stream.memory_plan(plain, ids.numel(), 32, 16)["parts"]


def test_streamed_calibration_refuses_a_run_that_does_not_fit(tiny_model, tokdir, text, monkeypatch):
    import trtmoe.quant.stream as stream

    model = tiny_model("olmoe", seed=4)
    monkeypatch.setattr(stream, "available_memory", lambda device: 1 << 20)
    with pytest.raises(InputError, match=r"needs about .* GiB .* available") as got:
        calibrate(model, text, None, tokenizer=tokdir, samples=2, seq_len=16, runner="stream", formats=("int8",))
    # A rounding fitted to the rows holds statistics while a layer is scored (cross-fitted: per fold too).
    assert "rounding statistics" in str(got.value)
    with pytest.raises(InputError, match=r"needs about .* GiB .* available") as got:
        calibrate(model, text, None, tokenizer=tokdir, samples=2, seq_len=16, runner="stream", formats=("int8",),
                  rounding="rtn")
    assert "rounding statistics" not in str(got.value)
    sm = stream.StreamedModel(model)
    parts = {cf: stream.memory_plan(sm, 1 << 16, 64, 16, rounding="awq_gptq", cross_fit=cf)["parts"] for cf in (0, 1)}
    assert parts[1]["rounding_statistics"] > parts[0]["rounding_statistics"] > 0
    # DeepSeek-V4's hidden state between layers is hc_mult copies of the hidden size (hyper-connections): the
    # boundaries and their gradients are counted that wide.
    ids = torch.arange(3, 19).reshape(1, 16)
    assert sm.hidden_copies(ids) == 1
    v4 = stream.StreamedModel(tiny_model("deepseek_v4", seed=3))
    copies = v4.hidden_copies(ids)
    assert copies == v4.config.hc_mult == 4
    one, wide = (stream.memory_plan(v4, 1 << 16, 64, 16, copies=n)["parts"]["activations"] for n in (1, copies))
    assert wide == one * (4 * copies + 2) // 6


def test_calibrate_command_runs_the_stream_and_prints_what_it_measured(tiny_model, tokdir, text, tmp_path):
    model = tiny_model("olmoe", seed=4)
    r = cli("calibrate", model, "--data", text, "--tokenizer", tokdir, "--samples", 2, "--seq-len", 16,
            "--formats", "int8", "--rounding", "rtn", "-o", tmp_path / "c")
    assert "layer-streamed calibration on cpu" in r.output
    out = " ".join(r.output.split())
    assert re.search(r"calibration took [\d.]+ CPU-s \([\d.]+ s wall\) = [\d.]+× one forward over the same 32 "
                     r"tokens", out), out
    assert "Calibration phases (stream runner, fisher, rtn rounding, cpu" in out
    calib = json.loads((tmp_path / "c" / "calib.json").read_text())
    assert calib["architecture"] == "olmoe" and calib["sensitivity"]["runner"] == "stream"
    cost = json.loads((tmp_path / "c" / "calib.cost.json").read_text())
    assert set(cost["phases"]) >= {"forward", "backward", "scoring"} and cost["runner"] == "stream"
    assert cost["calib_sha256"] == hashlib.sha256((tmp_path / "c" / "calib.json").read_bytes()).hexdigest()
    r = cli("calibrate", model, "--data", text, "--tokenizer", tokdir, "--samples", 2, "--seq-len", 16,
            "--sensitivity", "exact", "-o", tmp_path / "d", expect=None)
    assert r.exit_code != 0 and "fisher" in r.output and "Traceback" not in r.output


def test_streamed_calibration_records_the_input_amax_the_export_needs(tiny_model, tokdir, text, tmp_path):
    """A streamed calibration over activation-quantizing formats records each MoE layer's input amax
    (fc: the largest |input| of any routed token, per channel), the same as transformers' own forward
    shows at the experts seam; a budgeted unified-HF convert then needs no token ids of its own."""
    import transformers

    model = _tiny(tiny_model, "olmoe", tokdir, tmp_path)
    samples, seq_len = 4, 24
    res = calibrate(model, text, tmp_path / "c", samples=samples, seq_len=seq_len, formats=("fp8", "nvfp4"),
                    rounding="rtn", batch_size=2, runner="stream")
    tok = load_tokenizer(tokdir)
    tok.add_bos = True
    ids = token_batches(load_texts(text), tok, samples, seq_len)
    full = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    seen: dict[int, torch.Tensor] = {}
    for i, lay in enumerate(full.model.layers):
        found = find_experts(lay)
        if found:
            found[0].register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(
                i, torch.maximum(seen.get(i, torch.zeros(a[0].shape[-1])), a[0].reshape(-1, a[0].shape[-1]).abs().amax(0))))
    with torch.no_grad():
        full(ids)
    assert sorted(map(int, res["input_amax"])) == sorted(seen)
    for l, want in seen.items():
        got = torch.tensor(res["input_amax"][str(l)]["fc"])
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), l
        assert (torch.tensor(res["input_amax"][str(l)]["proj"]) > 0).any()
    r = cli("convert", model, "-o", tmp_path / "u", "--target", "vllm", "--sm", "100", "--calib", tmp_path / "c",
            "--budget", "6")
    assert r.exit_code == 0, r.output
    q = json.loads((tmp_path / "u" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] in ("FP8", "NVFP4", "MIXED_PRECISION")


def test_gpt_oss_searches_see_the_inputs_its_experts_compute(tiny_model, tokdir, tmp_path):
    """gpt-oss's experts (transposed, interleaved gate/up, biases, clamped swiglu with +1 on up): the
    activation-aware searches' ``proj`` inputs are taken through the experts' own gating at the seam,
    so ``proj`` applied to them (plus its bias) is what transformers' experts module outputs for each
    expert, and not what silu(gate)·up would give."""
    import transformers

    from trtmoe.quant import awq
    from trtmoe.quant.stream import ExpertLayout, HFExperts

    model = _tiny(tiny_model, "gpt_oss", tokdir, tmp_path)
    full = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    mod = find_experts(full.model.layers[0])[0]
    E, H = mod.gate_up_proj.shape[0], full.config.hidden_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, H, generator=g) * 2
    routed = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(48)])
    ref = {}
    with torch.no_grad():
        for e in range(E):
            rows = x[routed.eq(e).any(-1)]
            ref[e] = mod(rows, torch.full((len(rows), 1), e), torch.ones(len(rows), 1))
    hf = HFExperts(mod, ExpertLayout.of(mod, H), "fp32")
    assert not hf.layout.standard
    own = awq.collect_layer(hf.fc, hf.proj, x, routed, layer=0, min_routed=1, fc_bias=hf.fc_bias,
                            activation=hf.activation)
    silu = awq.collect_layer(hf.fc, hf.proj, x, routed, layer=0, min_routed=1)
    for e in range(E):
        assert own[(e, "proj")].inputs.own_gating and not silu[(e, "proj")].inputs.own_gating
        for st, close in ((own, True), (silu, False)):
            a = st[(e, "proj")].rows
            assert a.shape[0] == ref[e].shape[0]
            y = a @ hf.proj[e].t() + hf.proj_bias[e]
            assert torch.allclose(y, ref[e], rtol=1e-4, atol=1e-4 * float(ref[e].abs().max())) == close, (e, close)
    # A proj statistic rebuilt without the experts' gating (after the layer's weights were let go) is
    # refused, never rebuilt as silu(gate)·up.
    st = own[(0, "proj")]
    st.inputs.act = None
    awq._GRAM.clear()
    with pytest.raises(InputError, match="own gating"):
        st.rows
