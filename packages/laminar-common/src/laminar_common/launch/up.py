"""``laminar up``: pick a launcher for a job file and run it.

The one place that knows both backends, so neither launcher imports the other.
"""

from __future__ import annotations

from laminar_common.errors import ConfigError
from laminar_common.launch.jobfile import for_resume, load_job

__all__ = ["run_job"]


def run_job(path: str, overrides: list[str] = (), backend: str = "local",
            ray_address: str | None = None, num_cpus: int | None = None,
            start: str = "new") -> int:
    """``start``: ``new`` (refused where the run dir holds an earlier run's checkpoints),
    ``resume`` (every resumable tier from its state: ``--resume``) or ``fresh`` (a new run
    that removes the earlier run's checkpoints, said on the console)."""
    if start not in ("new", "resume", "fresh"):
        raise ConfigError(f"start {start!r}: use new, resume or fresh")
    job = load_job(path, list(overrides))
    if start == "resume":
        job = for_resume(job)
    if backend == "ray":
        from laminar_common.launch.ray_backend import run_on_ray  # ray is an optional extra

        return run_on_ray(job, ray_address, num_cpus, job_file=str(path), start=start)
    if backend != "local":
        raise ConfigError(f"backend {backend!r}: use local or ray")
    from laminar_common.launch.local import LocalLauncher

    return LocalLauncher(job, job_file=str(path), start=start).run()
