"""The command line's part of each format, one module per format, named by its registry record
(``zerobatch.formats.<fmt>.FORMAT.cli`` and ``.convert``)."""
