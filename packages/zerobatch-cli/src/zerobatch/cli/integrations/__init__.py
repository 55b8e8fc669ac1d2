"""zerobatch on existing data engines: :mod:`~zerobatch.cli.integrations.datatrove` (a
pipeline step that writes a TOKSTREAM part per datatrove task). Each engine is an optional
extra (``zerobatch-cli[datatrove]``), imported only by its module."""
