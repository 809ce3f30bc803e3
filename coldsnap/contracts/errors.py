"""Every error code a receipt of this build can carry, and what it means.

A code names the step that failed (admission checks before anything starts; then each step of the
capture or restore sequence), never the exception type that surfaced. The receipt's ``error.code``
is one of these; a manager can branch on it (retry, recapture, page someone) without parsing the
message. ``tests/unit/test_error_codes.py`` checks that every code the code base raises is listed here
and docs/contracts.md's table matches.
"""

from __future__ import annotations

__all__ = ["ERROR_CODES", "is_known_code"]

ERROR_CODES: dict[str, str] = {
    # The request and the envelope
    "request.unsupported": "the request names an operation, engine, snapshot driver or policy value this build does not implement",
    "request.operation": "the request is for another operation than the command given (`coldsnap restore` got a capture request)",
    "interrupted": "SIGINT/SIGTERM: what the operation had started was stopped and removed",
    "internal": "a bug: the message names the exception; nothing the operation started is left running",
    # Capture
    "capture.topology": "the request's workers do not match the engine's ranks; a request of several launch units "
                        "without one unit's selection; or the units' own requests disagree (engine, model, policy, "
                        "their ranks)",
    "unit.rendezvous": "one unit of several: the activation's coordinator could not be served or joined, or another "
                       "unit failed or stopped responding (the message names it and its error), or a unit-level "
                       "barrier timed out naming the units missing",
    "capture.port": "the unit has no serving port for the canary, or the port is taken or locked by another "
                    "operation (the message names its operation id and pid)",
    "capture.exists": "the output directory already holds a committed artifact",
    "capture.launch": "the serving command could not be started, or exited before it was ready (the message has "
                      "its exit status or signal and the last lines of its log)",
    "capture.ready": "the engine's agents or HTTP server did not become ready within the timeout",
    "capture.agent": "the engine's HTTP port answers but no coldsnap agent did within 60 s of it: the engine runs "
                     "without coldsnap (vLLM / SGLang without `--load-format coldsnap`, or coldsnap not installed "
                     "in the engine's Python environment)",
    "capture.canary": "the engine did not answer the canary prompt",
    "capture.reference": "the captured engine answered the canary or a probe differently from a plain start of the same "
                         "command (twice: the message names the request and token), or plain starts of the command "
                         "disagree on this host, or the plain reference start did not come up or answer; nothing "
                         "committed",
    "capture.secret": "the serving command gives its server an API key (vLLM / SGLang --api-key, VLLM_API_KEY passed "
                      "on): it would be in the capsule; nothing started (give the key at restore: --api-key-file)",
    "capture.prepare": "a rank's agent could not drain, release its graphs and memory, tear down NCCL or write its packs",
    "capture.connections": "the serving tree holds TCP connections to peers outside it (each named), which no "
                           "restore could take up again; nothing was checkpointed",
    "capture.driver_floor": "the NVIDIA driver is below the snapshot driver's floor",
    "capture.template": "n580: the template launcher exited or did not reach its pre-CUDA boundary (a preloaded "
                        "module failed to import?)",
    "capture.template_nvidia": "n580: the template holds NVIDIA userspace-driver state — placement ABI 2: any driver "
                               "library or device (a preloaded CUDA torch maps libcuda); ABI 1: an open device "
                               "(a preloaded module initialized CUDA or NVML)",
    "capture.template_restore": "n580: the template's image could not be restored or placed at capture",
    "capture.cuda_checkpoint": "the CUDA checkpoint of a GPU process failed (the tree was unlocked again)",
    "capture.criu_dump": "CRIU could not dump the process tree",
    "capture.residual": "a rank wrote no residual pack",
    "capture.recovery": "weights.mode recovery, but a rank's engine loaded its weights from no safetensors file to pin, "
                        "or one could not be read",
    "capture.verify": "the capture's own restore of its capsule failed or did not serve the captured canary; nothing "
                      "committed (the message names the restore's error code)",
    "capture.commit": "the capsule manifest or descriptor could not be written (e.g. the disk is full); nothing committed",
    # Restore admission: nothing has started
    "admission.artifact": "no committed artifact at the path, or its descriptor does not decode",
    "admission.driver": "the artifact was captured for another engine or snapshot driver than the request names",
    "admission.topology": "the artifact has several launch units and the request selects none of them (each unit "
                          "is restored on its own host, all at once), or its units are not the artifact's",
    "admission.platform": "the artifact was captured on another CPU architecture",
    "admission.kernel": "another kernel release, with compatibility.kernel=exact",
    "admission.cuda": "the artifact needs a GPU and the CUDA checkpoint API, which this host lacks",
    "admission.driver_floor": "the NVIDIA driver is below the snapshot driver's floor or the captured one",
    "admission.gpu": "another GPU model or compute capability than the capture's; the GPUs asked for (`--gpu`) are "
                     "not on this host, or fewer than the image's ranks; or `--gpu` for an artifact captured "
                     "without a GPU",
    "admission.gpu_memory": "a GPU the restore goes to has less free memory than the capsule's processes used there "
                            "while serving (needed vs free, per GPU)",
    "admission.criu": "CRIU is missing, too old, or `criu check` fails",
    "admission.host_thp": "--host-thp (COLDSNAP_HOST_THP=always) was asked, and the host's transparent-huge-page "
                          "mode cannot be read or set (needs root and a kernel with THP)",
    "admission.capsule": "the capsule manifest or an image is missing, changed, or from a coldsnap that cannot read it",
    "admission.files": "a host file the captured tree maps or holds open (a library, the interpreter, a mapped "
                       "model file) is missing, or its size, mode or modification time changed since capture "
                       "(named by path)",
    "admission.payload": "a native pack is missing or its bytes do not match the descriptor (and no recovery "
                         "source may stand in: weights.mode native, or none recorded or verified)",
    "admission.recovery": "weights.mode recovery, and a pinned safetensors file is not recorded, missing or changed",
    "admission.port": "the serving port, or another port the restored tree binds (moved by the port generation), is "
                      "taken; or another restore, warm, wake or capture of the port is in flight (the message names "
                      "its operation id and pid; the loser touched nothing)",
    "admission.standby": "another warm or wake of the artifact's standby is in flight (one standby per artifact; "
                         "the message names its operation id and pid)",
    "admission.placement": "the placement cannot be given: the template speaks another placement ABI (or an ABI-1 "
                           "template under another NVIDIA driver), a malformed placement value, or another port "
                           "for an n610 image",
    # Restore: each failure kills what was restored and leaves the artifact as it was
    "restore.state_dir": "the runtime state directory cannot be created (choose one with --state-dir)",
    "restore.criu": "CRIU could not restore the process tree",
    "restore.placement": "one unit of several is placed at an address of another family than its capture's",
    "restore.lease": "the restored agents did not take the launcher's lease",
    "restore.place": "n580: the restored template refused the placement or did not answer",
    "restore.engine_start": "n580: the placed engine exited or its agent / HTTP server did not answer in time",
    "restore.cuda": "the CUDA restore of a GPU process failed",
    "restore.pack_arrival": "restore oci:// on a host with no copy: a pack it hydrates while pulling stopped arriving "
                            "(the registry or the network failed, or a chunk did not match its digest); what arrived "
                            "stays in the cache for the next restore to resume",
    "restore.resume": "a rank's agent could not map and fill its memory, rebuild NCCL or recapture its graphs",
    "restore.api_key": "--api-key-file: the key file could not be read or holds no key, or the restored server's HTTP "
                       "process has no coldsnap key gate (captured by an older build, or its engine plugin did not load) "
                       "or refused the key",
    "restore.canary": "the restored server did not answer the canary, or answered other tokens than at capture",
    # Warm standby (`coldsnap warm`): admission and the restore's steps as above, then
    "warm.standby": "a rank's agent could not park as a standby (rebuild NCCL), or the standby could not be recorded",
    # Waking a standby (`coldsnap wake`); a failed wake stops the standby
    "wake.standby": "no live warm standby of the artifact (never warmed, woken already, expired or killed)",
}


def is_known_code(code: str) -> bool:
    return code in ERROR_CODES
