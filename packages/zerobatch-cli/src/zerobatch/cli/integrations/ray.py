"""The import path of earlier releases for the Ray Data sink: it is
:mod:`zerobatch.prepare.integrations.ray`."""

from zerobatch.prepare.integrations.ray import TokenStreamDatasink

__all__ = ["TokenStreamDatasink"]
