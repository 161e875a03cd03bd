"""``eagle3ray verify``: check every committed hidden-state block of a run against its manifest, and repair.

Each block entry of ``hidden_states/manifest.json`` records the file's size and sha256; this reads every block
(streamed, several at once) and reports the missing, truncated or corrupt ones. ``repair`` drops them from the
manifest (:meth:`eagle3ray.blocks.Manifest.drop`): the manifest becomes incomplete, and the next ``eagle3ray
extract`` (or ``run``) extracts exactly their samples again and recomputes the token frequencies. Nothing that
checks out is touched.

The same checks guard the readers: a resumed extraction checks the sizes of the blocks committed since the last
snapshot, finishing one checks every block's size, and training checks sizes and (``train.verify_blocks:
sha256``, the default) checksums before Ray Train starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import blocks, storage


@dataclass
class VerifySummary:
    """What verification found (``problems``: block path -> what is wrong) and what repair did."""

    path: str
    blocks: int = 0
    samples: int = 0
    problems: dict[str, str] = field(default_factory=dict)
    repaired: bool = False
    samples_dropped: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems or self.repaired

    def render(self) -> str:
        lines = [f"eagle3ray verify {self.path}: {self.blocks} blocks, {self.samples} samples committed; "
                 + (f"{len(self.problems)} missing or corrupt" if self.problems else "all match the manifest")]
        lines += [f"  PROBLEM {p}: {why}" for p, why in self.problems.items()]
        if self.repaired:
            lines.append(f"  repaired: {len(self.problems)} block(s), {self.samples_dropped} samples dropped from the "
                         "manifest; run `eagle3ray extract` (or `run`) with this config to extract them again")
        elif self.problems:
            lines.append("  re-run with --repair to drop them from the manifest so that they are extracted again")
        return "\n".join(lines)


def verify(cfg, repair: bool = False, sha256: bool = True) -> VerifySummary:
    """Verify (and with ``repair`` drop) the committed blocks of ``cfg``'s run.

    With ``repair`` the run's writer lease is held throughout (:mod:`eagle3ray.lease`): the manifest is read and
    rewritten by one writer, never beside a running extraction.

    Raises:
        FileNotFoundError: the run has no hidden-state manifest.
        eagle3ray.lease.LeaseHeld: with ``repair``, another writer holds the run.
    """
    paths = storage.run_paths(cfg)
    if repair:
        from .lease import held

        with held(paths, "verify --repair"):
            return _verify(paths, True, sha256)
    return _verify(paths, False, sha256)


def _verify(paths: storage.RunPaths, repair: bool, sha256: bool) -> VerifySummary:
    data, _ = blocks.read_committed(paths.fs, paths.hidden_states)
    man = blocks.Manifest(paths.fs, paths.hidden_states, data)
    s = VerifySummary(path=f"{paths.uri}/hidden_states", blocks=len(data["blocks"]), samples=data["counts"]["samples"])
    s.problems = man.verify(sha256=sha256)
    if s.problems and repair:
        s.samples_dropped = man.drop(list(s.problems))
        s.repaired = True
    return s
