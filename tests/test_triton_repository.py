"""Triton repository generator: values from the engine's config, contradictions rejected by field,
no placeholder left, every config.pbtxt parsed back with Triton's ModelConfig schema. No server."""

from __future__ import annotations

import json
import sys
import os
import subprocess
from dataclasses import replace
from pathlib import Path

from conftest import require
import pytest
from click.testing import CliRunner

from trtmoe.checkpoint.writer import convert
from trtmoe.errors import InputError, TrtmoeError
from trtmoe.parallel.mapping import Mapping
from trtmoe.runtime.checkpoint_reader import load_config
from trtmoe.triton import commands
from trtmoe.triton.cpu_binding import format_cores
from trtmoe.triton.engine_dir import EMBEDDED, TENSORRT_LLM, read_engine_dir
from trtmoe.triton.repository import (MANIFEST, MODELS, TOKENIZER_SUBDIR, check_repository_configs, fill_template,
                                      generate_repository, parse_model_config, templates_dir, validate_repository)
from trtmoe.triton.serve import Endpoints, TritonInstall, build_launch_command

BUILD = {"max_batch_size": 8, "max_input_len": 48, "max_seq_len": 96, "max_beam_width": 1, "tokens_per_block": 32}


def train_tokenizer(out: Path, vocab_size: int) -> Path:
    """A small byte-level BPE tokenizer (with <s> prepended) saved for AutoTokenizer."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:20]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(out)
    return out


def write_embedded_engine(out: Path, checkpoint: Path, **build) -> Path:
    """The `trtmoe build --backend embedded` layout: config.json pointing at the checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"backend": "embedded", "checkpoint": str(Path("..") / checkpoint.name) if checkpoint.parent == out.parent
           else str(checkpoint), "build_config": {**BUILD, **build}}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def write_trt_engine(out: Path, checkpoint: Path, *, tp: int = 1, pp: int = 1, **build) -> Path:
    """A trtllm-build engine dir layout (config.json + rank files); the rank files' bytes are never read here."""
    pretrained = json.loads((checkpoint / "config.json").read_text())
    mapping = pretrained["mapping"] = {**pretrained["mapping"], "world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    if mapping.get("moe_tp_size", 1) * mapping.get("moe_ep_size", 1) != tp:  # the experts split as the rest
        mapping.update(moe_tp_size=tp, moe_ep_size=1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"version": "1.2.0", "pretrained_config": pretrained,
                                                 "build_config": {**BUILD, "max_num_tokens": 8192, **build}}))
    for r in range(tp * pp):
        (out / f"rank{r}.engine").write_bytes(b"\0")
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("triton-repo")
    hf = tiny_model("mixtral", vocab_size=320)
    ckpt = root / "ckpt"
    convert(hf, ckpt)
    tok = train_tokenizer(root / "tokenizer", 320)
    return {"root": root, "ckpt": ckpt, "tok": tok, "engine": write_embedded_engine(root / "engine", ckpt)}


def _texts(repo: Path) -> dict[str, str]:
    return {p.relative_to(repo).as_posix(): p.read_text(errors="replace") for p in repo.rglob("*")
            if p.is_file() and not p.relative_to(repo).as_posix().startswith(TOKENIZER_SUBDIR + "/")}


def test_read_engine_dir_both_layouts(setup):
    info = read_engine_dir(setup["engine"])
    assert info.backend == EMBEDDED and info.checkpoint_dir == setup["ckpt"].resolve()
    assert (info.max_batch_size, info.max_input_len, info.max_seq_len, info.max_beam_width) == (8, 48, 96, 1)
    assert info.architecture == "MixtralForCausalLM" and info.model.vocab_size == 320 and info.launch_world_size == 1
    trt = read_engine_dir(write_trt_engine(setup["root"] / "trt2", setup["ckpt"], tp=2, max_batch_size=16))
    assert trt.backend == TENSORRT_LLM and trt.mapping.world_size == 2 and trt.launch_world_size == 2
    assert trt.max_batch_size == 16 and trt.rank_files == ("rank0.engine", "rank1.engine")
    # Both layouts hold the model as every other stage reads it from the checkpoint config.
    ckpt_model = load_config(setup["ckpt"])
    assert info.model == ckpt_model and info.mapping == ckpt_model.mapping
    assert trt.model == replace(ckpt_model, mapping=Mapping.create(tp=2))
    assert ckpt_model.architecture == trt.architecture == "MixtralForCausalLM"


def test_trt_engine_of_an_unknown_architecture(setup):
    eng = write_trt_engine(setup["root"] / "trt-llama", setup["ckpt"])
    cfg = json.loads((eng / "config.json").read_text())
    cfg["pretrained_config"].update(architecture="LlamaForCausalLM", trtmoe={})
    (eng / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="'LlamaForCausalLM' is not one trtmoe knows"):
        read_engine_dir(eng)


@pytest.mark.parametrize("mutate, field", [
    (lambda c: c["build_config"].pop("max_batch_size"), "max_batch_size"),
    (lambda c: c["build_config"].update(max_input_len="64"), "max_input_len"),
    (lambda c: c["build_config"].update(max_input_len=500), "max_input_len"),
    (lambda c: c.pop("checkpoint"), "checkpoint"),
    (lambda c: c.pop("build_config"), "build_config"),
])
def test_read_engine_dir_names_bad_field(setup, tmp_path, mutate, field):
    cfg = json.loads((setup["engine"] / "config.json").read_text())
    cfg["checkpoint"] = str(setup["ckpt"])
    mutate(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=field):
        read_engine_dir(tmp_path)


def test_trt_engine_missing_rank_file(setup):
    eng = write_trt_engine(setup["root"] / "trt-missing", setup["ckpt"], tp=2)
    (eng / "rank1.engine").unlink()
    with pytest.raises(InputError, match="rank1.engine"):
        read_engine_dir(eng)


def test_embedded_repository(setup):
    out = setup["root"] / "repo"
    r = generate_repository(setup["engine"], out, tokenizer_dir=setup["tok"], max_batch_size=4)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(MODELS)
    assert (out / MANIFEST).is_file()
    # No placeholder anywhere (the tokenizer is data and excluded), every config parses.
    texts = _texts(out)
    assert texts and not [name for name, t in texts.items() if "${" in t]
    configs = validate_repository(out)
    assert set(configs) == set(MODELS)
    llm, ens, bls = configs["tensorrt_llm"], configs["ensemble"], configs["tensorrt_llm_bls"]
    assert llm.backend == "python" and llm.max_batch_size == 4 and ens.max_batch_size == 4
    # Upstream's defaults: not decoupled, the prompt included in non-streamed outputs.
    assert not llm.model_transaction_policy.decoupled and not bls.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params["exclude_input_in_output"] == "false"
    # Relative to the repository root: the repository can move together with its engine.
    assert params["engine_dir"] == os.path.relpath(setup["engine"], out) and not os.path.isabs(params["engine_dir"])
    assert int(params["torch_num_threads"]) >= 1
    assert params["max_input_len"] == "48" and params["max_seq_len"] == "96"
    assert params["stream_interval"] == "0"  # auto
    assert (out / "tensorrt_llm" / "1" / "model.py").is_file()
    # The 1.2.x tensor names, and v0.19.0's older names for the same two inputs.
    for cfg in (ens, bls, llm):
        names = {i.name for i in cfg.input}
        assert {"min_tokens", "seed", "min_length", "random_seed"} <= names, cfg.name
    assert "return_num_output_tokens" in {i.name for i in ens.input}
    # The copied tokenizer loads and matches the source.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(r.tokenizer_dir))
    src = AutoTokenizer.from_pretrained(str(setup["tok"]))
    assert tok.encode("def main(): pass") == src.encode("def main(): pass")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["launch_world_size"] == 1 and manifest["settings"]["max_batch_size"] == 4


def test_tokenizer_found_beside_checkpoint(setup, tmp_path):
    with pytest.raises(InputError, match="no tokenizer found"):
        generate_repository(setup["engine"], tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    # `trtmoe convert` keeps the tokenizer in <checkpoint>/tokenizer; that one is used by default.
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(setup["ckpt"], ckpt)
    shutil.copytree(setup["tok"], ckpt / "tokenizer")
    r = generate_repository(write_embedded_engine(tmp_path / "engine", ckpt), tmp_path / "repo")
    assert (r.tokenizer_dir / "tokenizer.json").read_bytes() == (setup["tok"] / "tokenizer.json").read_bytes()


def test_streaming_repository(setup):
    out = setup["root"] / "repo-stream"
    generate_repository(setup["engine"], out, tokenizer_dir=setup["tok"], streaming=True, exclude_input_in_output=True)
    configs = validate_repository(out)
    assert configs["tensorrt_llm"].model_transaction_policy.decoupled
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in configs["tensorrt_llm"].parameters.items()}
    assert params["exclude_input_in_output"] == "true"


@pytest.mark.parametrize("kwargs, field, values", [
    (dict(max_batch_size=64), "max_batch_size", ("64", "8")),
    (dict(max_beam_width=4), "max_beam_width", ("4", "1")),
    (dict(max_input_len=100), "max_input_len", ("100", "48")),
    (dict(max_seq_len=1000), "max_seq_len", ("1000", "96")),
    (dict(world_size=2), "world_size", ("2",)),
    (dict(max_batch_size=0), "max_batch_size", ("0",)),
    (dict(kv_cache_free_gpu_mem_fraction=0.5), "kv_cache_free_gpu_mem_fraction", ()),
    (dict(stream_interval=-1), "stream_interval", ("-1",)),
])
def test_contradicting_settings_are_rejected(setup, tmp_path, kwargs, field, values):
    with pytest.raises(InputError) as e:
        generate_repository(setup["engine"], tmp_path / "repo", tokenizer_dir=setup["tok"], **kwargs)
    msg = str(e.value)
    assert field in msg and all(v in msg for v in values), msg
    assert not (tmp_path / "repo").exists() and not list(tmp_path.glob(".repo*"))


def test_tensorrt_engine_repository(setup):
    eng = write_trt_engine(setup["root"] / "trt-tp2", setup["ckpt"], tp=2)
    out = setup["root"] / "repo-trt"
    r = generate_repository(eng, out, tokenizer_dir=setup["tok"], kv_cache_free_gpu_mem_fraction=0.5)
    configs = validate_repository(out)
    llm = configs["tensorrt_llm"]
    assert llm.backend == "tensorrtllm"
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params["gpt_model_path"] == str(eng.resolve())
    assert params["gpt_model_type"] == "inflight_fused_batching" and params["kv_cache_free_gpu_mem_fraction"] == "0.5"
    assert params["max_beam_width"] == "1"
    assert not (out / "tensorrt_llm" / "1" / "model.py").exists() and (out / "tensorrt_llm" / "1").is_dir()
    assert r.launch_world_size == 2
    # TensorRT engines take their limits from the engine: a smaller runtime value is refused.
    with pytest.raises(InputError, match="max_input_len"):
        generate_repository(eng, setup["root"] / "x", tokenizer_dir=setup["tok"], max_input_len=16)
    with pytest.raises(InputError, match="mapping.world_size"):
        generate_repository(eng, setup["root"] / "x", tokenizer_dir=setup["tok"], world_size=1)
    with pytest.raises(InputError, match="stream_interval applies to the embedded engine only"):
        generate_repository(eng, setup["root"] / "x", tokenizer_dir=setup["tok"], stream_interval=4)


def test_tensorrt_engine_repository_served_from_another_path(setup, tmp_path):
    """``--engine-path`` writes where the engine will be on the serving machine as gpt_model_path (the
    C++ backend opens it as given); the rest of the repository is the same. Relative paths, and the
    option on an embedded engine (whose repository refers to it relatively), are refused."""
    eng = write_trt_engine(setup["root"] / "trt-deploy", setup["ckpt"])
    here, there = tmp_path / "here", tmp_path / "there"
    generate_repository(eng, here, tokenizer_dir=setup["tok"])
    generate_repository(eng, there, tokenizer_dir=setup["tok"], engine_path="/models/mixtral/engine")
    params = {k: v.string_value for k, v in validate_repository(there)["tensorrt_llm"].parameters.items()}
    assert params["gpt_model_path"] == "/models/mixtral/engine"
    for m in MODELS:  # the same repository but for that one path
        a, b = ((d / m / "config.pbtxt").read_text() for d in (here, there))
        assert b == a.replace(str(eng.resolve()), "/models/mixtral/engine"), m
    assert str(eng.resolve()) not in (there / "tensorrt_llm" / "config.pbtxt").read_text()
    with pytest.raises(InputError, match="must be an absolute path"):
        generate_repository(eng, tmp_path / "x", tokenizer_dir=setup["tok"], engine_path="models/engine")
    with pytest.raises(InputError, match="engine_path applies to TensorRT-LLM engines only"):
        generate_repository(setup["engine"], tmp_path / "y", tokenizer_dir=setup["tok"], engine_path="/models/e")
    res = _run_repo([str(eng), "-o", str(tmp_path / "cli"), "--tokenizer", str(setup["tok"]),
                     "--engine-path", "/srv/engine"])
    assert res.exit_code == 0, res.output
    assert "served from /srv/engine" in res.output
    assert 'key: "gpt_model_path" value: { string_value: "/srv/engine" }' in (
        tmp_path / "cli" / "tensorrt_llm" / "config.pbtxt").read_text()


@pytest.mark.parametrize("max_num_tokens,chunked", [(8192, "false"), (32, "true")])
def test_chunked_context_follows_the_engines_step_size(setup, max_num_tokens, chunked):
    # BUILD's max_input_len is 48: a 32-token step can only take such a prompt in chunks.
    eng = write_trt_engine(setup["root"] / f"trt-mnt{max_num_tokens}", setup["ckpt"], max_num_tokens=max_num_tokens)
    out = setup["root"] / f"repo-mnt{max_num_tokens}"
    generate_repository(eng, out, tokenizer_dir=setup["tok"])
    params = {k: v.string_value for k, v in validate_repository(out)["tensorrt_llm"].parameters.items()}
    assert params["enable_chunked_context"] == chunked


def test_launch_command_one_rank_per_engine_rank(tmp_path):
    inst = TritonInstall(kind="system", binary=Path("/opt/tritonserver/bin/tritonserver"), backends_dir=None)
    ep = Endpoints("127.0.0.1", 8000, 8001, 8002)
    one = build_launch_command(tmp_path, inst, endpoints=ep, world_size=1)
    assert one[0].endswith("tritonserver") and "--grpc-port=8001" in one and "--http-address=127.0.0.1" in one
    assert "--disable-auto-complete-config" in one  # as upstream's launcher: the written configs are used as they are
    cmd = build_launch_command(tmp_path, inst, endpoints=ep, world_size=4)
    assert Path(cmd[0]).name == "mpirun" and cmd.count(":") == 3 and cmd.count("-n") == 4
    ranks = " ".join(cmd).split(" : ")
    assert "--grpc-port=8001" in ranks[0] and "--load-model" not in ranks[0]
    for i, r in enumerate(ranks[1:], start=1):
        assert "--model-control-mode=explicit" in r and "--load-model=tensorrt_llm" in r
        assert "--grpc-port" not in r and f"shm-region-prefix-name=trtmoe{i}_" in r
        assert "--disable-auto-complete-config" in r


def test_fill_template_rejects_unknown_and_leftover_placeholders():
    with pytest.raises(TrtmoeError, match="nope"):
        fill_template("max_batch_size: ${nope}", {}, where="t")
    with pytest.raises(TrtmoeError, match="unresolved"):
        fill_template("name: \"$${x}\"", {}, where="t")  # an escaped placeholder still leaves "${"
    assert fill_template("max_batch_size: ${n}", {"n": "4"}, where="t") == "max_batch_size: 4"


def test_parse_back_catches_bad_pbtxt():
    with pytest.raises(TrtmoeError, match="ModelConfig"):
        parse_model_config('name: "x"\nmax_batch_size: ${triton_max_batch_size}\n', where="x/config.pbtxt")
    with pytest.raises(TrtmoeError, match="ModelConfig"):
        parse_model_config('name: "x"\nno_such_field: 3\n', where="x/config.pbtxt")


def test_cross_model_check_catches_miswiring(setup):
    configs = validate_repository(setup["root"] / "repo")
    step = configs["ensemble"].ensemble_scheduling.step[1]
    step.input_map["no_such_input"] = "_INPUT_ID"
    with pytest.raises(TrtmoeError, match="no_such_input"):
        check_repository_configs(configs)
    configs = validate_repository(setup["root"] / "repo")  # Triton refuses an ensemble tensor nobody reads
    configs["ensemble"].ensemble_scheduling.step[0].output_map["OUT_REQUEST_KEY"] = "_REQUEST_KEY"
    with pytest.raises(TrtmoeError, match="_REQUEST_KEY.*used by no step"):
        check_repository_configs(configs)
    configs = validate_repository(setup["root"] / "repo")
    configs["tensorrt_llm_bls"].model_transaction_policy.decoupled = True  # the default repository is not
    with pytest.raises(TrtmoeError, match="decoupled"):
        check_repository_configs(configs)


def test_every_template_placeholder_is_filled(setup):
    import re

    from trtmoe.triton.repository import resolve_settings, template_values

    placeholders = set()
    for m in MODELS:
        placeholders |= set(re.findall(r"\$\{(\w+)\}", (templates_dir() / m / "config.pbtxt").read_text()))
    values = template_values(read_engine_dir(setup["engine"]), resolve_settings(read_engine_dir(setup["engine"])))
    assert placeholders and placeholders <= set(values)


def test_foreign_tokenizer_is_rejected(setup, tmp_path):
    big = train_tokenizer(tmp_path / "big-tok", 600)
    with pytest.raises(InputError, match="vocab_size"):
        generate_repository(setup["engine"], tmp_path / "repo", tokenizer_dir=big)


def test_repo_command(setup, tmp_path):
    from trtmoe.cli import TrtmoeGroup

    group = TrtmoeGroup(commands={c.name: c for c in commands.COMMANDS})
    runner = CliRunner()
    for c in commands.COMMANDS:
        help_text = runner.invoke(group, [c.name, "--help"]).output
        assert "Example" in help_text, c.name
    ok = runner.invoke(group, ["repo", str(setup["engine"]), "-o", str(tmp_path / "r"), "--tokenizer", str(setup["tok"]),
                              "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["settings"]["max_batch_size"] == 8
    bad = runner.invoke(group, ["repo", str(setup["engine"]), "-o", str(tmp_path / "r2"), "--tokenizer",
                               str(setup["tok"]), "--max-batch-size", "64"])
    assert bad.exit_code == 2 and "max_batch_size 64" in bad.output
    again = runner.invoke(group, ["repo", str(setup["engine"]), "-o", str(tmp_path / "r"), "--tokenizer", str(setup["tok"])])
    assert again.exit_code == 2 and "--force" in again.output


def test_pre_and_post_processing_import_no_transformers_or_torch():
    """They load the tokenizer with the `tokenizers` library alone (smaller processes, any container)."""
    import ast

    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        tree = ast.parse((templates_dir() / model / "1" / "model.py").read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"transformers", "torch", "trtmoe"}, (model, imported)


def test_embedded_tensorrt_llm_model_file_imports_no_torch_at_module_level():
    """Triton imports a Python model's file twice at load (a model-level stub completes the config,
    then each instance's stub runs it): importing the embedded tensorrt_llm model must not import
    torch, which only its initialize needs."""
    code = (f"import sys, types\n"
            f"sys.modules['triton_python_backend_utils'] = types.ModuleType('triton_python_backend_utils')\n"
            f"import importlib.util as u\n"
            f"s = u.spec_from_file_location('m', {str(templates_dir() / 'tensorrt_llm' / '1' / 'model.py')!r})\n"
            f"s.loader.exec_module(u.module_from_spec(s))\n"
            f"print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_cancel_senders_get_the_channel_module_beside_them(setup, tmp_path):
    """postprocessing and tensorrt_llm_bls import the cancel channel by a plain module name from
    their own version directory: the repository carries trtmoe's module there, which needs the
    standard library only (those models also run where trtmoe is not installed)."""
    import ast

    from trtmoe.triton import cancel_channel

    src = Path(cancel_channel.__file__).read_bytes()
    tree = ast.parse(src)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    r = generate_repository(setup["engine"], tmp_path / "repo", tokenizer_dir=setup["tok"])
    for model in ("postprocessing", "tensorrt_llm_bls"):
        assert (r.path / model / "1" / "trtmoe_cancel_channel.py").read_bytes() == src
        assert "from trtmoe_cancel_channel import CancelSender" in (r.path / model / "1" / "model.py").read_text()
    assert not (r.path / "preprocessing" / "1" / "trtmoe_cancel_channel.py").exists()


def test_tokenizer_facts_for_the_tokenizers_only_models(setup, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    r = generate_repository(setup["engine"], tmp_path / "repo", tokenizer_dir=setup["tok"])
    facts = json.loads((r.tokenizer_dir / "trtmoe_tokenizer.json").read_text())
    hf = AutoTokenizer.from_pretrained(str(setup["tok"]))
    assert (facts["eos_token_id"], facts["pad_token_id"], facts["bos_token_id"]) == (
        hf.eos_token_id, hf.pad_token_id, hf.bos_token_id)
    assert set(hf.all_special_ids) <= set(facts["special_ids"])
    tok = Tokenizer.from_file(str(r.tokenizer_dir / "tokenizer.json"))
    for text in ("def main(): pass", "x = [1, 2]  # ok", "日本語"):
        assert tok.encode(text).ids == hf.encode(text)
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == hf.decode(hf.encode(text),
                                                                                       skip_special_tokens=True)


def _run_repo(args):
    from trtmoe.cli import TrtmoeGroup

    group = TrtmoeGroup(commands={c.name: c for c in commands.COMMANDS})
    return CliRunner().invoke(group, ["repo", *args])


def test_missing_optional_dependency_is_one_line_naming_the_extra(setup, tmp_path, monkeypatch):
    import shutil
    import sys

    # A SentencePiece-only tokenizer folder needs transformers (+ sentencepiece) to become tokenizer.json.
    spm = tmp_path / "spm-tok"
    spm.mkdir()
    (spm / "tokenizer.model").write_bytes(b"\0" * 16)
    shutil.copy(setup["tok"] / "tokenizer_config.json", spm / "tokenizer_config.json")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    out = _run_repo([str(setup["engine"]), "-o", str(tmp_path / "r1"), "--tokenizer", str(spm)])
    assert out.exit_code == 1 and out.output.count("\n") == 1, out.output
    assert "pip install 'trtmoe[tokenizer]'" in out.output and "Traceback" not in out.output
    # Checking the configs needs tritonclient (the serve extra).
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)
    out = _run_repo([str(setup["engine"]), "-o", str(tmp_path / "r2"), "--tokenizer", str(setup["tok"])])
    assert out.exit_code == 1 and out.output.count("\n") == 1, out.output
    assert "pip install 'trtmoe[serve]'" in out.output
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_default_torch_threads_leave_room_for_pre_and_post():
    from trtmoe.triton.repository import default_torch_threads

    assert default_torch_threads(3, cores=2) == 1  # never oversubscribe a small machine
    assert default_torch_threads(3, cores=1) == 1
    assert default_torch_threads(3, cores=16) == 14
    assert default_torch_threads(3, engine_instances=2, cores=16) == 7
    assert default_torch_threads(8, cores=8) == 4


def test_streaming_and_exclude_flags(setup, tmp_path):
    out = _run_repo([str(setup["engine"]), "-o", str(tmp_path / "r"), "--tokenizer", str(setup["tok"]),
                     "--decoupled", "--exclude-input", "--torch-threads", "3", "--json"])
    assert out.exit_code == 0, out.output
    s = json.loads(out.output)["settings"]
    assert s["streaming"] and s["exclude_input_in_output"] and s["torch_num_threads"] == 3
    configs = validate_repository(tmp_path / "r")
    assert configs["tensorrt_llm"].model_transaction_policy.decoupled
    assert configs["tensorrt_llm"].parameters["torch_num_threads"].string_value == "3"


def test_repo_and_serve_options_merge_cli_over_yaml_over_defaults(setup, tmp_path):
    from click.testing import CliRunner

    from trtmoe.cli import main

    y = tmp_path / "c.yaml"
    y.write_text("repo:\n  streaming: true\n  max_batch_size: 2\nserve:\n  grpc_port: 9101\n  http_port: 9100\n")
    run = CliRunner().invoke
    r = run(main, ["repo", str(setup["engine"]), "-o", str(tmp_path / "a"), "--tokenizer", str(setup["tok"]),
                   "-c", str(y)])
    assert r.exit_code == 0, r.output
    a = validate_repository(tmp_path / "a")
    assert a["tensorrt_llm"].model_transaction_policy.decoupled and a["tensorrt_llm"].max_batch_size == 2
    r = run(main, ["repo", str(setup["engine"]), "-o", str(tmp_path / "b"), "--tokenizer", str(setup["tok"]),
                   "-c", str(y), "--no-streaming", "--max-batch-size", "3"])
    assert r.exit_code == 0, r.output
    b = validate_repository(tmp_path / "b")
    assert not b["tensorrt_llm"].model_transaction_policy.decoupled and b["tensorrt_llm"].max_batch_size == 3
    r = run(main, ["serve", str(tmp_path / "b"), "-c", str(y), "--http-port", "9200", "--print-command"])
    assert r.exit_code == 0, r.output
    assert "--grpc-port=9101" in r.output and "--http-port=9200" in r.output, r.output
    y.write_text("repo:\n  streaming: maybe\n")
    r = run(main, ["repo", str(setup["engine"]), "-o", str(tmp_path / "c"), "-c", str(y)])
    assert r.exit_code == 2 and "repo.streaming" in r.output and not (tmp_path / "c").exists()


def test_repository_is_an_artifact_verify_checks(setup, tmp_path):
    from click.testing import CliRunner

    from trtmoe.cli import main
    from trtmoe.errors import VerifyError
    from trtmoe.checkpoint.manifest import read_repository_manifest

    out = tmp_path / "repo"
    generate_repository(setup["engine"], out, tokenizer_dir=setup["tok"])
    man = json.loads((out / MANIFEST).read_text())
    assert man["tool"] == "trtmoe" and man["kind"] == "triton-repository"
    assert "ensemble/config.pbtxt" in man["files"]
    run = CliRunner().invoke
    r = run(main, ["verify", str(out)])
    assert r.exit_code == 0, r.output
    cfg = out / "postprocessing" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "\n# edited\n")
    r = run(main, ["verify", str(out)])
    assert r.exit_code == 1 and "postprocessing/config.pbtxt" in r.output
    (out / MANIFEST).write_text("[1, 2")
    with pytest.raises(VerifyError, match="not valid JSON"):
        read_repository_manifest(out)  # a broken manifest is an error, not an empty one
    (out / MANIFEST).unlink()
    assert read_repository_manifest(out) == {}  # a repository from elsewhere has none


def test_streaming_repository_wires_the_request_key_for_cancellation(setup, tmp_path):
    """Streaming (decoupled) embedded repository: preprocessing's per-request key reaches
    tensorrt_llm and, through tensorrt_llm's responses, postprocessing (Triton refuses a step fed
    from two decoupled origins), which runs without a dynamic batcher (a batcher drops cancelled
    requests unseen) and knows whom to stop; the default (unary) repository keeps its batcher."""
    streaming = generate_repository(setup["engine"], tmp_path / "s", tokenizer_dir=setup["tok"],
                                    streaming=True)
    configs = validate_repository(streaming.path)
    pre, llm, post = configs["ensemble"].ensemble_scheduling.step
    assert pre.output_map["OUT_REQUEST_KEY"] == llm.input_map["request_key"] == "_REQUEST_KEY"
    assert llm.output_map["request_key"] == post.input_map["REQUEST_KEY"]
    assert not configs["postprocessing"].HasField("dynamic_batching")
    assert configs["postprocessing"].parameters["cancel_stop_model"].string_value == "tensorrt_llm"
    default = validate_repository(setup["root"] / "repo")
    assert "REQUEST_KEY" not in default["ensemble"].ensemble_scheduling.step[2].input_map
    assert default["postprocessing"].HasField("dynamic_batching")
    assert default["postprocessing"].parameters["cancel_stop_model"].string_value == ""


def test_gather_flags_from_build_to_engine_info(setup, tmp_path):
    """`trtmoe build --gather-context-logits --gather-generation-logits` records both flags in the
    embedded engine's build_config, as trtllm-build does, and the engine reader returns them; an
    engine built without them reads False, and trtllm-build's gather_all_token_logits means both."""
    from click.testing import CliRunner

    from trtmoe.cli import main

    eng = tmp_path / "engine"
    r = CliRunner().invoke(main, ["build", str(setup["ckpt"]), "-o", str(eng), "--backend", "embedded",
                                  "--max-input-len", "48", "--gather-context-logits", "--gather-generation-logits"])
    assert r.exit_code == 0, r.output
    bc = json.loads((eng / "config.json").read_text())["build_config"]
    assert bc["gather_context_logits"] is True and bc["gather_generation_logits"] is True
    info = read_engine_dir(eng)
    assert info.gather_context_logits and info.gather_generation_logits
    plain = read_engine_dir(setup["engine"])
    assert not plain.gather_context_logits and not plain.gather_generation_logits
    trt = read_engine_dir(write_trt_engine(tmp_path / "trt", setup["ckpt"], gather_all_token_logits=True))
    assert trt.gather_context_logits and trt.gather_generation_logits


def test_decode_cores_setting(setup, tmp_path):
    out = _run_repo([str(setup["engine"]), "-o", str(tmp_path / "auto"), "--tokenizer", str(setup["tok"]),
                     "--decode-cores", "auto", "--torch-threads", "1"])
    assert out.exit_code == 0, out.output
    assert "decode cores   auto" in out.output
    params = validate_repository(tmp_path / "auto")["tensorrt_llm"].parameters
    assert params["decode_cores"].string_value == "auto"
    assert json.loads((tmp_path / "auto" / MANIFEST).read_text())["settings"]["decode_cores"] == "auto"
    require("pytriton")
    from trtmoe.cli import main
    from trtmoe.triton.cpu_binding import allowed_cores, plan

    # The launch command says where serve would start the server and which cores it leaves the model.
    shown = CliRunner().invoke(main, ["serve", str(tmp_path / "auto"), "--print-command"])
    assert shown.exit_code == 0, shown.output
    bound = plan("auto", 1, allowed_cores())
    if isinstance(bound, tuple):
        assert f"TRTMOE_DECODE_CORES={format_cores(bound[0])}\ntaskset -c {format_cores(bound[1])} " in shown.output
    else:
        assert "decode_cores not applied" in shown.output and "taskset" not in shown.output
    # A list: one torch thread per core unless told otherwise, and written in its shortest form.
    r = generate_repository(setup["engine"], tmp_path / "list", tokenizer_dir=setup["tok"], decode_cores="3,1-2")
    assert (r.settings.decode_cores, r.settings.torch_num_threads) == ("1-3", 3)
    params = validate_repository(tmp_path / "list")["tensorrt_llm"].parameters
    assert (params["decode_cores"].string_value, params["torch_num_threads"].string_value) == ("1-3", "3")
    # YAML reads a lone core as a number.
    (tmp_path / "c.yaml").write_text("repo:\n  decode_cores: 1\n")
    out = _run_repo([str(setup["engine"]), "-o", str(tmp_path / "yaml"), "--tokenizer", str(setup["tok"]),
                     "-c", str(tmp_path / "c.yaml")])
    assert out.exit_code == 0 and "decode cores   1 " in out.output, out.output
    r = generate_repository(setup["engine"], tmp_path / "none", tokenizer_dir=setup["tok"])
    assert r.settings.decode_cores is None
    assert validate_repository(tmp_path / "none")["tensorrt_llm"].parameters["decode_cores"].string_value == "none"


@pytest.mark.parametrize("kwargs,words", [
    (dict(decode_cores="1-x"), ("decode_cores", "'1-x'")),
    (dict(decode_cores="2", torch_num_threads=2), ("torch_num_threads 2", "1 decode core")),
])
def test_bad_decode_cores_are_refused(setup, tmp_path, kwargs, words):
    with pytest.raises(InputError) as e:
        generate_repository(setup["engine"], tmp_path / "repo", tokenizer_dir=setup["tok"], **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "repo").exists()


def test_decode_cores_are_for_the_embedded_engine(setup, tmp_path):
    eng = write_trt_engine(setup["root"] / "trt-cores", setup["ckpt"])
    with pytest.raises(InputError, match="embedded engine only"):
        generate_repository(eng, tmp_path / "repo", tokenizer_dir=setup["tok"], decode_cores="auto")


def test_typed_settings_write_what_the_same_flat_options_write(setup, tmp_path):
    from trtmoe.triton.repository import Limits, Placement, RepositorySettings, Scheduling, TokenizerSettings

    typed = RepositorySettings(limits=Limits(max_batch_size=4), scheduling=Scheduling(streaming=True, stream_interval=2),
                               tokenizer=TokenizerSettings(tokenizer_dir=setup["tok"]),
                               placement=Placement(torch_num_threads=1, weights="compute"))
    a = generate_repository(setup["engine"], tmp_path / "typed", typed)
    b = generate_repository(setup["engine"], tmp_path / "flat", tokenizer_dir=setup["tok"], max_batch_size=4,
                            streaming=True, stream_interval=2, torch_num_threads=1, weights="compute")
    assert a.settings == b.settings and a.files == b.files
    assert (a.settings.max_batch_size, a.settings.stream_interval, a.settings.weights) == (4, 2, "compute")
    params = {k: v.string_value for k, v in validate_repository(a.path)["tensorrt_llm"].parameters.items()}
    assert params["weights"] == "compute" and params["stream_interval"] == "2"
    # Flat options replace single settings of a typed one; the rest stay.
    c = generate_repository(setup["engine"], tmp_path / "both", typed, max_batch_size=2)
    assert (c.settings.max_batch_size, c.settings.stream_interval) == (2, 2)
    assert RepositorySettings.from_options(**typed.options()) == typed


def test_unknown_or_misplaced_settings_are_rejected(setup, tmp_path):
    from trtmoe.triton.repository import RepositorySettings

    with pytest.raises(InputError, match="unknown repository setting 'max_batch'"):
        RepositorySettings.from_options(max_batch=4)
    with pytest.raises(InputError, match="weights must be one of checkpoint, compute"):
        generate_repository(setup["engine"], tmp_path / "repo", tokenizer_dir=setup["tok"], weights="float64")
    assert not (tmp_path / "repo").exists()
