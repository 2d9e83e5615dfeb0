"""The embedded default's SQLite engine (`ENGINE: "core.sqlite_engine"`): see base.py."""
