#!/usr/bin/env bash
# Install and start a local PostgreSQL server (Debian's package) for the parallel-workers test, on loopback.
# Prints the SQLAlchemy URL on its last line; exits non-zero if the server cannot be had.
set -euo pipefail
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
python3 -m pip install -q --disable-pip-version-check psycopg2-binary
version=$(ls /usr/lib/postgresql | sort -n | tail -1)
pg_lsclusters -h | grep -q "^$version main" || pg_createcluster "$version" main >/dev/null
pg_ctlcluster "$version" main start 2>/dev/null || pg_ctlcluster "$version" main status >/dev/null
for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 && break; sleep 0.5; done
su postgres -c "psql -q -tc \"SELECT 1 FROM pg_roles WHERE rolname='autotune'\" | grep -q 1 || psql -q -c \"CREATE ROLE autotune LOGIN SUPERUSER PASSWORD 'autotune'\""
su postgres -c "psql -q -tc \"SELECT 1 FROM pg_database WHERE datname='autotune'\" | grep -q 1 || createdb -O autotune autotune"
echo "postgresql+psycopg2://autotune:autotune@127.0.0.1:5432/autotune"
