"""The import path of earlier releases for distributed preparation and ``commit``: it is
:mod:`zerobatch.prepare.tasks`."""

from zerobatch.prepare.tasks import (DEFAULT_UNIT_BYTES, PARTS_DIR, Destination, TaskRun, Unit, commit, part_build_id,
                                     plan_units, preparation_status, spread_hint, task_units, unit_owner)

__all__ = ["DEFAULT_UNIT_BYTES", "PARTS_DIR", "Destination", "TaskRun", "Unit", "commit", "part_build_id",
           "plan_units", "preparation_status", "spread_hint", "task_units", "unit_owner"]
