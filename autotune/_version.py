"""The package version, in a module of its own so that any module may read it without importing the package.

The minor version follows the report's schema version (``autotune.report.SCHEMA_VERSION``): 0.4 writes schema 4.
Every report before this one was written by 0.1.0 whatever its schema (the version was not raised with the schema);
docs/report.md#versions lists what each schema version changed.
"""

__version__ = "0.5.0"
