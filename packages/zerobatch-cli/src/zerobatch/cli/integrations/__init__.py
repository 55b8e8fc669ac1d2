"""The import paths of earlier releases for the preparation steps on data engines: they are
:mod:`zerobatch.prepare.integrations`."""
