"""The import path of earlier releases for the datatrove steps: they are
:mod:`zerobatch.prepare.integrations.datatrove`, where the tokenizing step is
:class:`~zerobatch.prepare.integrations.datatrove.TokenStreamStep`; ``TokenStreamWriter`` is
its name here."""

from zerobatch.prepare.integrations.datatrove import TokenStreamCommit, TokenStreamStep

TokenStreamWriter = TokenStreamStep

__all__ = ["TokenStreamCommit", "TokenStreamStep", "TokenStreamWriter"]
