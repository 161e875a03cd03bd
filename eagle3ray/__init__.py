"""eagle3ray: EAGLE-3 draft heads for a vLLM verifier, trained at cluster scale on Ray."""

from __future__ import annotations

import hashlib
import pathlib


def code_fingerprint() -> str:
    """The first 16 hex digits of a sha256 over this package's ``*.py`` files (relative name and bytes, sorted).

    The driver hands its fingerprint to Ray workers, which compare it with their own. Ray puts the
    driver's working directory on workers' ``sys.path``, so a second checkout with an ``eagle3ray/``
    folder there shadows the installed package in the workers only; the comparison turns that into a
    clear error instead of a job that silently runs other code. So does an edit to the package while a job
    runs (a worker that starts or restarts after it would run the edited code).
    """
    root = pathlib.Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def check_code_fingerprint(expected: str | None, where: str) -> None:
    """Raise ``RuntimeError`` when this process's ``eagle3ray`` differs from the driver's (``expected``).

    ``where`` names the process (e.g. "Ray Train worker 0"). ``expected`` None skips the check.
    """
    if expected is None:
        return
    mine = code_fingerprint()
    if mine != expected:
        raise RuntimeError(
            f"{where} imports eagle3ray from {pathlib.Path(__file__).resolve().parent} (code {mine}), which differs "
            f"from the driver's (code {expected}): the package was edited after the job started, or the driver's "
            "working directory holds another eagle3ray/ folder (Ray puts it on workers' sys.path). Re-run, from a "
            "directory without another checkout, with the code you mean to run.")
