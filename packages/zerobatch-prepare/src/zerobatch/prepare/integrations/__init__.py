"""Preparation on existing data engines: :mod:`~zerobatch.prepare.integrations.datatrove` (a
pipeline step that writes a TOKSTREAM part per datatrove task, and the commit as a stage) and
:mod:`~zerobatch.prepare.integrations.ray` (a Ray Data ``Datasink``), both on the task/commit
contract of :mod:`zerobatch.prepare.tasks`. Each engine is an optional extra
(``zerobatch-prepare[datatrove]``, ``zerobatch-prepare[ray]``), imported only by its module."""
