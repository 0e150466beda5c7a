"""``laminar up``: pick a launcher for a job file and run it.

The one place that knows both backends, so neither launcher imports the other.
"""

from __future__ import annotations

from laminar_common.errors import ConfigError
from laminar_common.launch.jobfile import load_job

__all__ = ["run_job"]


def run_job(path: str, overrides: list[str] = (), backend: str = "local",
            ray_address: str | None = None, num_cpus: int | None = None) -> int:
    job = load_job(path, list(overrides))
    if backend == "ray":
        from laminar_common.launch.ray_backend import run_on_ray  # ray is an optional extra

        return run_on_ray(job, ray_address, num_cpus, job_file=str(path))
    if backend != "local":
        raise ConfigError(f"backend {backend!r}: use local or ray")
    from laminar_common.launch.local import LocalLauncher

    return LocalLauncher(job, job_file=str(path)).run()
