"""Every error code a receipt can carry is registered, documented, and named by the step that failed
(issue 13, item 3)."""

import ast
from pathlib import Path

import pytest

from coldsnap.contracts.errors import ERROR_CODES
from coldsnap.operation import OperationFailed

ROOT = Path(__file__).resolve().parents[2]
RAISERS = {"OperationFailed", "ErrorRecord", "check_driver_floor", "step", "hold_port", "hold_standby"}  # step(span, code)


def _codes_in_source() -> dict[str, str]:
    """Every string constant passed to something that makes a receipt's code, with where."""
    found = {}
    for path in [*(ROOT / "coldsnap").rglob("*.py"), *(ROOT / "coldsnap_vllm").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name not in RAISERS:
                continue
            arguments = node.args[1:] if name == "step" else [*node.args, *(k.value for k in node.keywords)]
            for argument in arguments:  # step(span, code): the span is a name, not a code
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str) and " " not in argument.value \
                        and (argument.value in ("internal", "interrupted") or "." in argument.value):
                    found[argument.value] = f"{path.relative_to(ROOT)}:{node.lineno}"
    return found


def test_every_code_raised_is_registered():
    unregistered = {code: where for code, where in _codes_in_source().items() if code not in ERROR_CODES}
    assert not unregistered, f"codes raised but not in coldsnap.contracts.errors.ERROR_CODES: {unregistered}"


def test_every_registered_code_is_raised_somewhere():
    raised = set(_codes_in_source()) | {"request.unsupported"}  # that one travels as UnsupportedRequest.code
    assert set(ERROR_CODES) - raised == set()


def test_the_docs_document_every_code():
    contracts = (ROOT / "docs" / "contracts.md").read_text()
    missing = [code for code in ERROR_CODES if f"| `{code}` |" not in contracts]
    assert not missing, f"docs/contracts.md's error-code table lacks {missing}"


def test_an_unregistered_code_is_a_bug_not_a_receipt():
    with pytest.raises(ValueError, match="unregistered error code 'restore.somewhere'"):
        OperationFailed("restore.somewhere", "no")


@pytest.mark.parametrize("sequence", ["restore", "capture"])
def test_a_step_reports_what_fails_in_it_with_its_own_code(sequence):
    """An OSError while CRIU restores is ``restore.criu``, not the ``restore.resume`` it used to become."""
    from types import SimpleNamespace

    from coldsnap.activation.capture_steps import CaptureSequence
    from coldsnap.activation.restore_steps import RestoreSequence
    from coldsnap.snapshot.criu_binary import CriuError
    from coldsnap.timing import OperationTimer

    owner = SimpleNamespace(timer=OperationTimer(None), engine=None, _last_log_line=lambda: "")  # no engine started
    step = (RestoreSequence if sequence == "restore" else CaptureSequence).step
    code = "restore.criu" if sequence == "restore" else "capture.criu_dump"
    for failure in (OSError(28, "No space left on device"), CriuError("restore", 1, "Error (criu/cr-restore.c)")):
        with pytest.raises(OperationFailed) as failed:
            with step(owner, "the.step", code):
                raise failure
        assert failed.value.code == code and str(failure) in failed.value.message
    with pytest.raises(OperationFailed) as failed:  # a step's own refusal keeps its code
        with step(owner, "the.step", code):
            raise OperationFailed("admission.port", "taken")
    assert failed.value.code == "admission.port"
