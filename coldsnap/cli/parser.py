"""The ``coldsnap`` argument parser: one function per command, each naming its handler."""

from __future__ import annotations


import argparse
from typing import Any, NoReturn, get_args

from coldsnap import __version__
from coldsnap.contracts.common import EngineName, GraphPolicyMode, SnapshotDriverName
from coldsnap.contracts.placement import PLACEMENT_ABIS
from coldsnap.contracts.profiles import ENGINE_ADAPTERS

from coldsnap.cli.handlers import (VALIDATORS, _cmd_artifact_operation, _cmd_capabilities, _cmd_capture,
                                   _cmd_coordinator, _cmd_demo, _cmd_doctor, _cmd_payload_verify, _cmd_publish,
                                   _cmd_pull, _cmd_status, _cmd_validate, _cmd_version)
from coldsnap.cli.flags import (add_api_key_flag, add_host_thp_flag, add_operation_flags, add_owner_flag,
                                add_state_dir_flag, add_unit_flags, add_weights_flag, port_argument, positive_int,
                                restore_arguments)
from coldsnap.cli.provider_command import add_provider
from coldsnap.cli.requests import _capture_request, _env_name
from coldsnap.operation import EXIT_USAGE


DESCRIPTION = """\
coldsnap captures an initialized LLM serving process (vLLM, SGLang at TP1) once and restores
it in seconds: CRIU + the CUDA checkpoint driver API for the process, a content-addressed native pack
for the weights.

Managers (Sparkrun, a Kubernetes operator) start with `coldsnap capabilities`; people start with
`coldsnap doctor` to see what this host can do.
"""


PAYLOAD_VERIFY_DESCRIPTION = """\
Verify that FILE holds the bytes its name promises: a native pack `<sha256>.pack` or residual
`<sha256>.residual` (or any file, with --expected). It is the verifier the library itself uses
(coldsnap.payload.validation.verify_file).

Trust rule: after a full hash matches, the verdict is recorded in `.coldsnap-validation.json` next to
FILE, bound to the file's (st_dev, st_ino, size, mtime_ns, ctime_ns). A later verify trusts that record
only while all five are unchanged (and the file had not changed within 50 ms before that hash);
otherwise it hashes FILE in full again and refreshes or removes the record. The method printed says
which happened: `record` or `full-hash`.

Exit status: 0 valid; 1 verified and rejected (digest mismatch); 2 usage error (missing or unreadable
file, a name that is not <sha256>.pack/.residual without --expected, a malformed --expected).
"""


class CommandParser(argparse.ArgumentParser):
    """argparse with a bad argument reported in one line and a pointer to ``--help``, not the whole usage
    block before it; exit status 2 as argparse's own. Subcommands' parsers are of this class too
    (``add_subparsers`` makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")


def _add_capabilities(commands: Any) -> None:
    p = commands.add_parser(
        "capabilities",
        help="print the static capabilities JSON (formats, engines, snapshot drivers, features)",
        description="Print what this build accepts and drives, as JSON on stdout: request/artifact/receipt/"
        "timing-event formats, the engine adapters it drives and their native materialization modes, the "
        "snapshot drivers it implements with their minimum NVIDIA driver, the operations it runs with their "
        "replay semantics, and features. Only what is built is listed; a request naming anything else is "
        "refused (code request.unsupported). It is a static contract: `coldsnap doctor` says what this host "
        "can actually do.",
    )
    p.add_argument("--canonical", action="store_true", help="canonical JSON (sorted keys, no whitespace) instead of indented")
    p.set_defaults(func=_cmd_capabilities)


def _add_version(commands: Any) -> None:
    p = commands.add_parser("version", help="print the coldsnap, Python and native extension versions",
                            description="Print the coldsnap version, the Python it runs on, and how the native "
                            "extension coldsnap._C was built (or why it does not load).")
    p.set_defaults(func=_cmd_version)


def _add_doctor(commands: Any) -> None:
    p = commands.add_parser(
        "doctor",
        help="check this host: CRIU, NVIDIA driver, CUDA checkpoint API, GPUs",
        description="Report what this host can do: the CRIU coldsnap would use (COLDSNAP_CRIU or PATH), its "
        "version and `criu check` verdict (needs root), the NVIDIA driver, the CUDA driver API with the "
        "checkpoint and VMM entry points, the GPUs, and which of the snapshot drivers this build implements "
        "are usable. Always exits 0 when it could look; read the verdicts.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout instead of a table")
    p.set_defaults(func=_cmd_doctor)


def _add_validate(commands: Any) -> None:
    p = commands.add_parser(
        "validate",
        help="strictly validate a request, artifact descriptor, receipt or timing-event stream",
        description="Strictly decode FILE ('-' for stdin) as the given contract. Exit 0 and one summary line "
        "when valid; exit 2 with one line per problem on stderr otherwise (unknown field, wrong format "
        "number, missing field, wrong type, duplicate key, not JSON). `validate secrets DIR` scans every file of the "
        "artifact DIR (page images included; the native weight packs with --include-packs) for well-known token "
        "formats (Hugging Face, OpenAI-style, GitHub, AWS access key ids, Slack, JWTs, PEM private keys) and for the "
        "values of this environment's secret-named variables, and reads the names the descriptor says the capsule "
        "holds: one line per finding, FILE:OFFSET: KIND, never the value; exit 0 clean, 1 secrets found, 2 bad input.",
    )
    p.add_argument("kind", choices=sorted([*VALIDATORS, "secrets"]), help="which contract FILE holds; secrets: FILE is "
                   "an artifact directory, every file of which is scanned for secrets")
    p.add_argument("file", metavar="FILE", help="path of the document, or - for stdin; for secrets the artifact directory")
    p.add_argument("--include-packs", action="store_true", help="secrets: scan the native weight packs too (model "
                   "parameters, GBs; left out by default)")
    p.add_argument("--json", action="store_true", help="secrets: one JSON object on stdout (findings by file, offset, "
                   "kind; never a value)")
    p.set_defaults(func=_cmd_validate)


def _add_payload(commands: Any) -> None:
    p = commands.add_parser(
        "payload",
        help="native payload packs: verify a pack or residual against its content digest",
        description="Native payload packs: content-addressed files (<sha256>.pack, <sha256>.residual) of preserved "
        "GPU bytes. `payload verify` checks one against its SHA-256, trusting the directory's "
        ".coldsnap-validation.json only while the file's (st_dev, st_ino, size, mtime_ns, ctime_ns) is unchanged "
        "since its last full hash (see `payload verify --help`).",
    )
    payload = p.add_subparsers(dest="payload_command", metavar="SUBCOMMAND", required=True)
    p = payload.add_parser(
        "verify",
        help="check a pack's bytes against its SHA-256 (trusting an unchanged validation record)",
        description=PAYLOAD_VERIFY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", metavar="FILE", help="the pack or residual file")
    p.add_argument("--expected", metavar="SHA256", help="expected SHA-256 (default: the one in FILE's name)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout: file, sha256, size_bytes, method, seconds, verdict")
    p.set_defaults(func=_cmd_payload_verify)


def _add_capture(commands: Any) -> None:
    p = commands.add_parser(
        "capture",
        help="start a serving command, validate it, and capture it into an artifact directory",
        description="For vLLM and SGLang, first start CMD plainly (no coldsnap agent) and record its answers to the "
        "canary and probes (the reference check, see --reference). Start CMD (without io_uring, in its own session, "
        "output to DIR/logs), wait for coldsnap's in-process agent and the HTTP port, record the canary (greedy, "
        "through POST /v1/completions) and require the reference's answers bit for bit, let the "
        "agent write the native packs and release model memory, CRIU-dump the process tree, restore it once "
        "(as `coldsnap restore DIR` would) and check the canary again, then commit DIR/artifact.json atomically: a "
        "capsule that cannot restore is never committed. A tensor-parallel command (--ranks N, or its own --tp / "
        "--tensor-parallel-size) is captured with one agent per rank; their NCCL communicators are torn "
        "down through a coordinator before the dump and rebuilt at restore. With --driver n580 the image is instead "
        "CMD's launcher stopped before the engine starts (a pre-CUDA template); the capture then restores and places it "
        "once to record the canary and write the native pack. Nothing of CMD is left running; a failure commits nothing. "
        "Exit 0 on success, 1 on a failed capture, 2 for bad input.",
    )
    p.add_argument("--out", help="artifact directory (must not hold a committed artifact)")
    p.add_argument("--port", type=port_argument, help="serving port (default: the command's --port)")
    # The contract's names stay choices, so that one this build lacks is refused by name (request.unsupported).
    p.add_argument("--engine", choices=get_args(EngineName), help="engine adapter (default: from the command when it "
                   "runs vllm, sglang or coldsnap.workloads.torch_lm; needed otherwise; implemented in this build: "
                   f"{', '.join(sorted(ENGINE_ADAPTERS))})")
    p.add_argument("--driver", choices=get_args(SnapshotDriverName), default="n610",
                   help="snapshot driver: n610 (default) captures the initialized serving process, CUDA state "
                   "included (NVIDIA driver 610+); n580 captures a template launcher stopped before the engine "
                   "touches CUDA (driver 580+, portable across drivers and GPUs; the engine starts again, with "
                   "the native pack hydrated at load time, on every restore)")
    p.add_argument("--preload", metavar="MOD,MOD", help="--driver n580: the modules the template imports before "
                   "its pre-CUDA boundary (default per engine, e.g. torch-lm: "
                   f"{','.join(ENGINE_ADAPTERS['torch-lm'].template_preload)}; vLLM: "
                   f"{','.join(ENGINE_ADAPTERS['vllm'].template_preload)}); none may open an NVIDIA device, and at "
                   "placement ABI 2 none may load the NVIDIA driver (a CUDA torch does: '' or --placement-abi 1)")
    p.add_argument("--placement-abi", type=int, choices=PLACEMENT_ABIS, help="--driver n580: 2 (default) — the "
                   "template holds no NVIDIA userspace driver and restores under any driver 580+; 1 — it may map the "
                   "driver's libraries (a preloaded CUDA torch does) and restores under this driver version only")
    p.add_argument("--model", help="model name recorded in the artifact (default: from the command)")
    p.add_argument("--ranks", type=int, metavar="N",
                   help="ranks, one worker each (with --units: this unit's; default: the command's --tp / "
                   "--tensor-parallel-size / --tp-size times its --pipeline-parallel-size / --pp-size, else 1, "
                   "over --units)")
    p.add_argument("--graphs", choices=get_args(GraphPolicyMode), metavar="POLICY",
                   help="CUDA graphs: retain (the captured graph executables restore with the process) or recreate "
                   "(dropped before the checkpoint, a smaller image, and captured again after each restore, which "
                   "costs what the engine's own graph capture costs); default: the driver's (n610: retain, n580: "
                   "recreate)")
    p.add_argument("--no-verify", action="store_true",
                   help="commit without the capture's own restore of the capsule (COLDSNAP_CAPTURE_VERIFY=0); saves "
                   "one restore's time, and a capsule that cannot restore is then found out by its first restore")
    p.add_argument("--reference", choices=("plain", "none"),
                   help="the reference check (COLDSNAP_CAPTURE_REFERENCE): plain (default for vLLM and SGLang) first starts "
                   "the command plainly, without coldsnap's agent, asks it the canary and probes of 8-600 tokens, stops "
                   "it, and the engine captured after it must give every token id and logprob bit back (on a mismatch "
                   "once more, then capture.reference, nothing committed); it costs one more start of the engine, at "
                   "capture only. none skips it, and the artifact says so (default for coldsnap.workloads.torch_lm)")
    p.add_argument("--reference-probes", metavar="LEN:TOKENS,...",
                   help="the reference check's own probes, asked after the canary's (COLDSNAP_REFERENCE_PROBES; default "
                   "8:32,40:32,100:32,183:32,287:32), e.g. fewer tokens where decoding is slow")
    p.add_argument("--canary-probes", metavar="LEN:TOKENS,...",
                   help="the canary's probes: token-id prompts of LEN tokens, TOKENS greedy tokens each, whose ids and "
                   "logprobs every restore must give back bit for bit (COLDSNAP_CANARY_PROBES; default 136:4,600:2: one "
                   "prefill inside a CUDA graph, one past the largest). More probes check more graph sizes and decode "
                   "steps, each at the cost of one more request per restore")
    p.add_argument("--env", action="append", type=_env_name, metavar="NAME", default=[],
                   help="pass this variable of coldsnap's environment on to CMD although its name says it bears a secret "
                   "(repeatable). By default CMD starts without them: *TOKEN*, *SECRET*, *PASSWORD*, *KEY*, *CREDENTIAL*, "
                   "*AUTH* and the like, AWS_*, AZURE_*, DOCKER_CONFIG, GOOGLE_APPLICATION_CREDENTIALS, whose values would "
                   "otherwise be in the capsule's page images (docs/secrets.md). A variable passed on is recorded by name "
                   "in the artifact, and `coldsnap publish` refuses the artifact unless --allow-secrets")
    add_unit_flags(p)
    add_operation_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the serving command")
    p.set_defaults(func=_cmd_capture)


def _add_restore(commands: Any) -> None:
    p = commands.add_parser(
        "restore",
        help="restore a captured artifact: admission, CRIU restore, hydration, canary",
        description="Admit the artifact (descriptor, platform, CRIU check, capsule, the host files the tree maps, "
        "native packs, the serving port and its lock — a concurrent restore, warm, wake or capture of the port "
        "is refused naming it —, room on every GPU it goes to) and, unless --prepare-only, restore the process tree while the payload is prefetched, let the agent map and "
        "hydrate the weights and zero the KV cache, and require the canary to give the captured tokens exactly. "
        "On failure everything restored is killed. A restore writes nothing inside DIR (it may be read-only, "
        "moved or a copy): the restored server's log, CRIU's files and validation records go to the state "
        "directory. Every restore is a replica of its own: it serves on --port (its tree's socket ports moved by "
        "one shift in a per-restore copy of the socket image, every bind probed first), in pid namespaces of its "
        "own, so one capsule restores several times at once, each on its own port and GPU. An n580 artifact (a "
        "pre-CUDA template) is restored, handed its placement (--port, --gpu, the native pack to load) and the "
        "engine's own startup runs in it before the canary. Exit 0 when serving, 1 on a failed restore, 2 for bad "
        "input.",
    )
    restore_arguments(p)
    p.set_defaults(func=_cmd_artifact_operation, operation="restore")


def _add_warm(commands: Any) -> None:
    p = commands.add_parser(
        "warm",
        help="restore an artifact ahead of demand into a warm standby that does not serve yet",
        description="Run restore's admission and its steps up to the CUDA restore (the tree restored, CUDA state "
        "back on this host's GPUs, NCCL rebuilt), then park it: no weights and no KV cache on the GPU, the serving "
        "port bound but answering nothing until `coldsnap wake`, the native pack read into the page cache. The "
        "standby is recorded under the state directory (`coldsnap status` lists it) and stops itself, leaving "
        "nothing behind, when no wake came within --ttl. One standby per artifact: warming a warm artifact "
        "succeeds without a second one. Exit 0 when parked, 1 on failure (nothing is left running), 2 for bad input.",
    )
    p.add_argument("artifact", nargs="?", metavar="DIR", help="artifact directory written by coldsnap capture, or "
                   "oci://REF: pulled (verified) into STATE/oci/ first")
    p.add_argument("--ttl", type=positive_int, metavar="SECONDS",
                   help="how long the standby waits for a wake before it stops itself (default 3600)")
    add_weights_flag(p)
    add_host_thp_flag(p)
    add_state_dir_flag(p)
    add_unit_flags(p)
    add_operation_flags(p)
    p.set_defaults(func=_cmd_artifact_operation, operation="warm")


def _add_wake(commands: Any) -> None:
    p = commands.add_parser(
        "wake",
        help="make a warm standby serve: hydrate its weights, zero its KV cache, check the canary",
        description="Take the warm standby of DIR (or of the standby ID `coldsnap status` shows): every rank maps "
        "and hydrates its weights from the native pack (or the pinned safetensors, by --weights), zeroes its KV "
        "cache and recaptures dropped CUDA graphs; the canary must give the captured tokens exactly. Then the "
        "standby is the serving process. A failed wake stops the standby. On a GPU the weights come from the "
        "pack the standby pinned at warm, and a plain `coldsnap wake DIR|ID` asks the standby to start filling "
        "them before anything else (they are released again if no resume takes them). Exit 0 when serving, 1 "
        "on a failed wake (or no standby: code wake.standby), 2 for bad input.",
    )
    p.add_argument("artifact", nargs="?", metavar="DIR|ID", help="artifact directory, or a standby id from coldsnap status")
    add_weights_flag(p)
    add_api_key_flag(p)
    add_state_dir_flag(p)
    add_unit_flags(p)
    add_operation_flags(p)
    p.set_defaults(func=_cmd_artifact_operation, operation="wake")


def _add_status(commands: Any) -> None:
    p = commands.add_parser(
        "status",
        help="list the warm standbys on this host",
        description="List the live warm standbys under the state directory: id, what their agents say "
        "(standby), root pid, serving port, age, deadline and artifact. Records of standbys that are gone "
        "(killed, expired) are removed on the way. Exit 0.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    add_state_dir_flag(p)
    p.set_defaults(func=_cmd_status)


def _add_demo(commands: Any) -> None:
    p = commands.add_parser(
        "demo",
        help="cold start vs restore of a serving process on this machine, phase by phase",
        description="Start a server plainly and time process start → first token; capture it; restore it and "
        "time restore start → first validated token; check that a further prompt gets the cold start's tokens; "
        "print the phases of both. --engine torch-lm (default): the reference workload "
        "(coldsnap.workloads.torch_lm; needs torch). --engine vllm: `vllm serve` of a tiny Llama built on the "
        "spot, on vLLM's CPU build (installed into .venv-vllm the first time, a few minutes), cold start with "
        "vLLM's own loader against the restore of `--load-format coldsnap`. --engine sglang --device cuda: "
        "`python -m sglang.launch_server` of a tiny Llama (SGLang installed in this Python; a GPU), SGLang's "
        "own loader against the restore of `--load-format coldsnap`. Needs root (CRIU).",
    )
    p.add_argument("--engine", choices=["torch-lm", "vllm", "sglang"], default="torch-lm",
                   help="what to serve (default torch-lm)")
    p.add_argument("--compile", action="store_true", help="vllm: keep torch.compile on (default --enforce-eager)")
    p.add_argument("--size", choices=["tiny", "1b", "8b"], default="tiny", help="workload size (default tiny)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="torch-lm: tensor-parallel ranks (one GPU each with --device cuda; default 1)")
    p.add_argument("--dir", help="where to keep the model, artifact and receipts (default: a temporary directory, "
                   "removed at the end)")
    p.add_argument("--json", action="store_true", help="the figures as JSON on stdout")
    p.add_argument("--verbose", action="store_true", help="show capture and restore progress")
    p.set_defaults(func=_cmd_demo)


def _add_publish(commands: Any) -> None:
    p = commands.add_parser(
        "publish",
        help="push an artifact to an OCI registry: capsules, packs and descriptor, each by digest",
        description="Push the artifact in DIR to REF (REGISTRY/REPOSITORY[:TAG]) as OCI artifacts: each worker's "
        "native pack as its own artifact, in fixed-size chunks (--chunk-size; each chunk a blob, pushed many at once "
        "and pulled many at once, a chunk the registry has not sent again; the index binds every chunk's digest to "
        "the pack's SHA-256), each unit's capsule (config capsule.json, the CRIU images as layers, digests bound to the "
        "capsule), the descriptor (artifact.json, request.json, logs), and one image index over them, tagged TAG. "
        "Every file is checked against its bound digest first; blobs and manifests the registry has are not sent "
        "again (a second publish sends only the index); blobs go up in parallel. Prints the pinned reference "
        "REGISTRY/REPOSITORY[:TAG]@sha256:DIGEST (what `pull` and `restore oci://` take). Credentials: "
        "$REGISTRY_AUTH_FILE, $XDG_RUNTIME_DIR/containers/auth.json, ~/.config/containers/auth.json, "
        "~/.docker/config.json (credHelpers, credsStore); TLS CAs: /etc/containers/certs.d/REGISTRY/*.crt or "
        "$SSL_CERT_FILE; plain HTTP only for registries in $COLDSNAP_PLAIN_HTTP_REGISTRIES. Before anything is sent, "
        "every file but the native weight packs is scanned for secrets (as `coldsnap validate secrets DIR` does): an "
        "artifact that holds any, or records a variable passed on with capture --env, is refused unless --allow-secrets. "
        "Exit 0 published, 1 failed (registry, credentials, a damaged artifact, secrets found), 2 bad input.",
    )
    p.add_argument("artifact", metavar="DIR", help="artifact directory written by coldsnap capture")
    p.add_argument("reference", metavar="REF", help="REGISTRY/REPOSITORY[:TAG] (oci:// optional)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: reference, digest, what was sent")
    p.add_argument("--chunk-size", default="256M", metavar="SIZE",
                   help="a pack's chunk size: bytes, or with K, M or G (default 256M; 64K to 4G, a multiple of 4K): "
                   "smaller chunks spread a small pack over more streams, larger ones cost fewer requests")
    p.add_argument("--allow-secrets", action="store_true",
                   help="publish even when the artifact holds secrets: names passed on with capture --env, or what "
                   "the scan before every publish finds (token formats, values of this environment's secret-named "
                   "variables; `coldsnap validate secrets DIR`, docs/secrets.md)")
    p.set_defaults(func=_cmd_publish)


def _add_pull(commands: Any) -> None:
    p = commands.add_parser(
        "pull",
        help="fetch a published artifact into a directory, every blob verified, atomically, resumable",
        description="Fetch the artifact REF names (REGISTRY/REPOSITORY:TAG or @sha256:DIGEST, oci:// optional) into "
        "DIR: the index, then every manifest and blob by digest, each blob's SHA-256 checked while it streams, "
        "large blobs in parallel byte ranges. Files land in .DIR.coldsnap-pull beside DIR and are renamed to DIR "
        "only when all match and the descriptor binds exactly them; an interrupted pull run again fetches only "
        "what is missing. Validation records are written as files arrive, so the first restore does not hash the "
        "pack again. A DIR that already holds the same artifact is left as it is. `coldsnap restore oci://REF` "
        "and `warm oci://REF` pull into STATE/oci/ the same way first. Credentials and TLS as for publish. Exit 0 "
        "pulled, 1 failed, 2 bad input (a bad reference, DIR holding something else).",
    )
    p.add_argument("reference", metavar="REF", help="REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST] (oci:// optional)")
    p.add_argument("directory", metavar="DIR", help="where the artifact goes (must not exist, or hold the same one)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: directory, digest, what was fetched")
    add_owner_flag(p)
    p.set_defaults(func=_cmd_pull)


def _add_coordinator(commands: Any) -> None:
    p = commands.add_parser(
        "coordinator",
        help="run the CSKV coordinator of one activation (authenticated barriers and small key/value)",
        description="Serve barriers and small key/value (<= 64 KiB) to the N ranks of one activation over ZeroMQ, "
        "and with --units to the launchers of its launch units (a capture or restore of several units, each on its "
        "own host, meets here: `coldsnap capture|restore --rendezvous HOST:PORT`). Every frame is authenticated "
        "with HMAC-SHA256 keyed by the token and sequenced per connection; anything else is dropped and logged. "
        "Ends when every unit (without --units: every rank) said BYE (exit 0) or the TTL runs out (exit 1).",
    )
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where to listen; port 0 picks a free one")
    p.add_argument("--token-file", required=True, metavar="F", help="file holding the activation token (>= 16 bytes)")
    p.add_argument("--ranks", required=True, type=positive_int, metavar="N", help="number of ranks of the activation")
    p.add_argument("--units", type=int, default=0, metavar="N",
                   help="number of launch units whose launchers meet here (default 0: ranks only)")
    p.add_argument("--ttl", type=float, default=600.0, metavar="SECONDS", help="lifetime limit (default 600)")
    p.add_argument("--endpoint-file", metavar="PATH", help="write the chosen endpoint here, atomically (JSON)")
    p.set_defaults(func=_cmd_coordinator)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="coldsnap", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"coldsnap {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_capabilities(commands)
    _add_version(commands)
    _add_doctor(commands)
    _add_validate(commands)
    _add_payload(commands)
    _add_capture(commands)
    _add_restore(commands)
    _add_warm(commands)
    _add_wake(commands)
    _add_status(commands)
    _add_demo(commands)
    _add_publish(commands)
    _add_pull(commands)
    _add_coordinator(commands)
    add_provider(commands)
    return parser


def capture_request(arguments: list[str]) -> dict:
    """The request document ``coldsnap capture ARGUMENTS`` would run (flags, ``--`` and the command), for a
    caller that adds to it what no flag says (a policy) before sending it with ``--request-json``."""
    return _capture_request(build_parser().parse_args(["capture", *arguments]))
