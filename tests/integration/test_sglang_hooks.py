"""coldsnap's SGLang hooks against SGLang 0.5.17's real modules (no GPU).

Runs when scripts/install-sglang.sh has made .venv-sglang (scripts/test.sh does; COLDSNAP_SGLANG_VENV
overrides the place): SGLang's GPU build, imported on a machine without a GPU. What runs here: SGLang's
own plugin loading (``load_plugins``: entry point + HookRegistry), its argument parser, ``LoadConfig``
and ``get_model_loader`` with ``--load-format coldsnap``, the memory-saver factory, the model runner's
hook, the request broadcast running the agent's steps (at TP 1), the constructors and attributes the TP > 1 teardown and rebuild use, and the plugin against an
SGLang that lacks hooks or is outside the supported range. Not run
here (SGLang has no CPU model path without its kernels): loading a model, the KV cache in its region,
the agent in a scheduler — those ran on the H200 (benchmarks/sglang_startup.py, `coldsnap demo --engine
sglang`); tests/unit/test_sglang_plugin.py covers the plugin's own logic with stand-ins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("COLDSNAP_SGLANG_VENV", ROOT / ".venv-sglang"))
PYTHON = VENV / "bin" / "python"

pytestmark = pytest.mark.skipif(not PYTHON.exists(), reason="SGLang is not installed (bash scripts/install-sglang.sh)")

PRELUDE = """
import logging, sys, warnings
warnings.filterwarnings("ignore")
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
"""


def run(code: str, tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    done = subprocess.run([str(PYTHON), str(script)], capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
    return done


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Llama the tests parse SGLang's arguments against (written once per module)."""
    path = tmp_path_factory.mktemp("sglang-model") / "model"
    subprocess.run([str(PYTHON), "-m", "coldsnap.workloads.tiny_llama", str(path)], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return path


def test_load_format_coldsnap_resolves_through_sglangs_own_plugin_loading(tmp_path, model):
    """In one SGLang process (its imports take ~20 s here): the load format through SGLang's own plugin
    loading and loader lookup; the speculative settings a STANDALONE draft gives the target's load; the
    model runner's, the scheduler's and the memory-occupation hooks in SGLang's real classes."""
    done = run(f"""
        from sglang.srt.plugins import load_plugins
        load_plugins()  # what launch_server, every scheduler and the detokenizer do first
        from coldsnap_sglang import compat
        missing = [symbol for symbol, found in compat.probe().items() if not found]
        assert not missing and compat.supported(compat.sglang_version()), (missing, compat.sglang_version())
        from sglang.srt.server_args import prepare_server_args
        args = prepare_server_args(["--model-path", "{model}", "--load-format", "coldsnap", "--device", "cpu"])
        assert args.load_format == "coldsnap", args.load_format
        from sglang.srt.configs.load_config import LoadConfig, LoadFormat
        from sglang.srt.model_loader.loader import get_model_loader
        from coldsnap_sglang.loader import ColdsnapModelLoader
        from coldsnap_sglang.process import ProcessState
        assert not ProcessState.active
        config = LoadConfig(load_format="coldsnap", model_loader_extra_config='{{"mode": "recovery", "num_threads": 4}}')
        assert config.load_format is ColdsnapModelLoader and ProcessState.active
        loader = get_model_loader(config)
        assert isinstance(loader, ColdsnapModelLoader) and loader.mode == "recovery" and loader.pack is None
        assert loader.load_config.load_format == LoadFormat.SAFETENSORS  # SGLang's loading reads safetensors
        assert loader.load_config.model_loader_extra_config == {{"num_threads": 4}}
        assert config.load_format is ColdsnapModelLoader  # the shared config still names the loader
        assert LoadConfig(load_format="safetensors").load_format == LoadFormat.SAFETENSORS  # others are SGLang's
        for extra, message in (({{"mode": "bogus"}}, "mode must be one of auto, native, recovery, cache-only-auto"),
                               ({{"mode": "native"}}, "coldsnap mode 'native' needs --model-loader-extra-config pack="),
                               ({{"bogus": 1}}, "Unexpected extra config keys")):
            try:
                get_model_loader(LoadConfig(load_format="coldsnap", model_loader_extra_config=extra))
            except ValueError as exc:
                assert message in str(exc), exc
            else:
                raise AssertionError(extra)
        import sglang.srt.model_executor.model_runner as model_runner  # the scheduler's import: the agent's hook
        from coldsnap_sglang.agent_bootstrap import after_alloc_memory_pool
        hooked = model_runner.ModelRunner.alloc_memory_pool
        assert getattr(hooked, "__wrapped__", None) is not None, hooked
        # speculative settings: SGLang's own parsing of a STANDALONE draft tells the target's load a draft follows
        import asyncio
        from sglang.srt.runtime_context import get_context
        for extra, expected in (([], None),
                                (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "{model}"],
                                 "inherited"),
                                (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "{model}",
                                  "--speculative-draft-load-format", "safetensors"], "safetensors")):
            args = prepare_server_args(["--model-path", "{model}", "--load-format", "coldsnap", "--device", "cpu", *extra])
            get_context().set_server_args(args)  # what a scheduler process does before it loads the model
            assert compat.speculative_draft_load_format() == expected, (extra, compat.speculative_draft_load_format())
        import sglang.srt.managers.scheduler as scheduler  # a scheduler process's import: the scheduler noted
        assert getattr(scheduler.Scheduler.init_all_cuda_graphs, "__wrapped__", None) is not None
        # the agent's steps run where SGLang's own request broadcast carries rank 0's marker (here at TP 1, where
        # the method broadcasts nothing: the marker goes in, the step runs on this thread, the marker goes out)
        import threading, time
        from types import SimpleNamespace
        from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver
        assert getattr(SchedulerRequestReceiver._broadcast_reqs_across_ranks, "__wrapped__", None) is not None
        from sglang.srt.runtime_context import publish
        from coldsnap_sglang import scheduler_thread
        publish(prepare_server_args(["--model-path", "{model}", "--device", "cpu"]), role="scheduler")
        receiver = object.__new__(SchedulerRequestReceiver)  # a frozen dataclass of the scheduler's sockets
        object.__setattr__(receiver, "ps", SimpleNamespace(tp_size=1, attn_tp_size=1, attn_cp_size=1))
        ran = []
        stepping = threading.Thread(target=lambda: ran.append(
            scheduler_thread.in_lockstep(lambda: threading.current_thread().name)))
        stepping.start()
        while not scheduler_thread.LOCKSTEP._submitted:
            time.sleep(0.001)
        assert receiver._broadcast_reqs_across_ranks(["request"]) == ["request"]
        stepping.join(10)
        assert ran == [threading.current_thread().name], ran
        from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin  # the server's
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput
        for name in ("release_memory_occupation", "resume_memory_occupation"):
            assert getattr(getattr(TokenizerControlMixin, name), "__wrapped__", None) is not None, name
        class Manager:
            server_args = args
        try:
            asyncio.run(TokenizerControlMixin.release_memory_occupation(Manager(), ReleaseMemoryOccupationReqInput()))
        except ValueError as exc:
            assert "/release_memory_occupation is not available on a server started with --load-format coldsnap" in str(exc)
        else:
            raise AssertionError("not refused")
        # TP > 1: what coldsnap_sglang.distributed reads on SGLang's groups and rebuilds with its constructors
        import inspect
        from sglang.srt.distributed import parallel_state
        from sglang.srt.distributed.device_communicators import (custom_all_reduce, custom_all_reduce_v2, pynccl,
                                                                 pynccl_wrapper, torch_symm_mem)
        for made, names in ((pynccl.PyNcclCommunicator, ("group", "device", "is_symmetric_memory_enabled")),
                            (custom_all_reduce.CustomAllreduce, ("group", "device")),
                            (custom_all_reduce_v2.CustomAllReduceV2, ("group", "device")),
                            (torch_symm_mem.TorchSymmMemCommunicator, ("group", "device"))):
            parameters = inspect.signature(made.__init__).parameters
            assert all(name in parameters for name in names), (made, list(parameters))
        for owner, attributes in ((parallel_state.GroupCoordinator, ("pynccl_comm", "ca_comm", "torch_symm_mem_comm",
                                   "pymscclpp_comm", "qr_comm", "device_group", "cpu_group", "ranks", "device")),
                                  (pynccl.PyNcclCommunicator, ("available", "comm", "nccl", "device")),
                                  (custom_all_reduce.CustomAllreduce, ("meta_ptrs", "buffer_ptrs", "rank", "_ptr",
                                                                       "original_disabled")),
                                  (pynccl_wrapper.NCCLLibrary, ("lib",))):
            source = inspect.getsource(owner.__init__)
            assert all(f"self.{{name}}" in source for name in attributes), (owner, attributes)
        assert "ncclCommAbort" not in inspect.getsource(pynccl_wrapper)  # why coldsnap binds it from `lib` itself
        from coldsnap_sglang.distributed import sglang_groups
        assert sglang_groups() == []  # SGLang's own registry, empty in a process that made no group
        print("ok")
    """, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok"
    assert "coldsnap" not in done.stderr.lower() or "warning" not in done.stderr.lower(), done.stderr


def test_memory_saver_is_coldsnaps_only_for_a_model_the_load_format_placed(tmp_path):
    done = run("""
        import torch
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter
        from coldsnap.agent.placement import place_model_in_region
        from coldsnap_sglang.memory_saver import ColdsnapMemorySaverAdapter
        from coldsnap_sglang.process import ProcessState
        assert not isinstance(TorchMemorySaverAdapter.create(enable=False), ColdsnapMemorySaverAdapter)
        ProcessState.active = True
        ProcessState.placed = place_model_in_region(torch.nn.Linear(8, 8))  # a host region here
        adapter = TorchMemorySaverAdapter.create(enable=False)
        assert isinstance(adapter, ColdsnapMemorySaverAdapter) and not adapter.enabled
        with adapter.region("kv_cache"):  # a host model: no pluggable allocator, SGLang's own allocation
            kv = torch.zeros(4)
        assert kv.sum() == 0
        print("ok")
    """, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok"


WITHOUT_A_HOOK = (
    ("compat.sglang_version = lambda: '0.4.9'", "SGLang 0.4.9 is outside the supported range"),
    ("compat.ALLOC_MEMORY_POOL = 'sglang.srt.model_executor.model_runner:ModelRunner.gone'",
     "the coldsnap agent (capture and restore of this server) disabled"),
    ("compat.HOOK_REGISTRY = 'sglang.srt.plugins.hook_registry:Gone'", "coldsnap sglang plugin disabled"),
)


def test_an_sglang_without_a_hook_runs_without_that_feature_and_one_warning(tmp_path):
    """Each case in its own SGLang process (plugins load once per process), all at once."""
    started = []
    for index, (patch, warning) in enumerate(WITHOUT_A_HOOK):
        script = tmp_path / f"probe-{index}.py"
        script.write_text(PRELUDE + textwrap.dedent(f"""
            from coldsnap_sglang import compat
            {patch}
            from sglang.srt.plugins import load_plugins
            load_plugins()  # never raises into SGLang
            import sglang.srt.model_executor.model_runner  # where the agent's hook would go
            from sglang.srt.configs.load_config import LoadConfig, LoadFormat
            assert LoadConfig(load_format="safetensors").load_format == LoadFormat.SAFETENSORS
            print("ok")
        """))
        started.append((warning, subprocess.Popen([str(PYTHON), str(script)], stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                                  env={**os.environ, "PYTHONPATH": str(ROOT)})))
    for warning, process in started:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0 and stdout.strip() == "ok", stderr[-4000:]
        assert sum(warning in line for line in stderr.splitlines()) == 1, (warning, stderr)


def test_a_speculative_shapes_draft_predicts_its_targets_tokens(tmp_path):
    """``tiny_llama``'s speculative shapes (benchmarks/sglang_speculative.py): the draft, made of the
    target's first layers, embedding and head, gives the target's greedy tokens (the target's later layers
    add nothing), and shares its tokenizer (SGLang's STANDALONE compares the vocabularies)."""
    done = run(f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from coldsnap.workloads.tiny_llama import LLAMA_3_8B, build_llama_shape
        config = {{**LLAMA_3_8B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
                  "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}}
        target = build_llama_shape("{tmp_path}/m", config, draft_layers=2, shape="test", device="cpu")
        answers = []
        for path in (target, "{tmp_path}/m-draft"):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            tokenizer = AutoTokenizer.from_pretrained(path)
            ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
            answers.append((model.config.num_hidden_layers, tokenizer.get_vocab(),
                            model.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()))
        (layers, vocab, tokens), (draft_layers, draft_vocab, draft_tokens) = answers
        assert (layers, draft_layers) == (4, 2) and vocab == draft_vocab and tokens == draft_tokens, answers
        print("ok")
    """, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok"


def test_a_key_given_at_restore_is_checked_by_sglangs_own_api_key_middleware(tmp_path):
    """The key gate (coldsnap/agent/api_key.py) in a process started under coldsnap, with SGLang's plugin
    registered: an app built afterwards passes everything; held (a capture, before its snapshot) its guarded paths
    answer 401 and /health 200; opened (a restore without a key) everything passes again; given a key over the
    gate's socket, SGLang's own add_api_key_middleware class decides: 401 without the key, 200 with it, /health
    open. (SGLang's HTTP server itself needs a GPU to start: the app here is a FastAPI app with its paths.)"""
    done = run("""
        import asyncio, os, uuid
        os.environ["COLDSNAP_CONTROL"] = f"@coldsnap-agent-{uuid.uuid4().hex[:16]}"
        from coldsnap_sglang import register
        register()
        from fastapi import FastAPI
        from coldsnap.agent.client import install_api_key, key_gate

        app = FastAPI()
        app.get("/v1/models")(lambda: {"ok": True})
        app.get("/health")(lambda: {"ok": True})

        async def status(path, key=None):
            headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
            scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
                     "headers": headers, "root_path": "", "scheme": "http", "server": ("127.0.0.1", 1),
                     "client": ("127.0.0.1", 2), "http_version": "1.1", "asgi": {"version": "3.0"}}
            sent = []
            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}
            async def send(message):
                sent.append(message)
            await app(scope, receive, send)
            return next(m["status"] for m in sent if m["type"] == "http.response.start")

        async def main():
            control = os.environ["COLDSNAP_CONTROL"]
            before = await status("/v1/models")
            key_gate(control, {"hold": True})  # what a capture does before its snapshot
            held = [await status("/v1/models"), await status("/health")]
            key_gate(control, {"open": True})  # a restore without a key
            opened = await status("/v1/models")
            reply = install_api_key(control, "s3cret-key")
            after = [await status("/v1/models"), await status("/v1/models", "wrong"), await status("/v1/models", "s3cret-key"),
                     await status("/health")]
            print("statuses", before, held, opened, after, reply["gates"], type(app.middleware_stack.current).__name__)

        asyncio.run(main())
        """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "statuses 200 [401, 200] 200 [401, 401, 200, 200] 1 _ApiKeyASGIMiddleware" in done.stdout, done.stdout
