#!/usr/bin/env bash
# `make postgres` (run by `make test`): the PostgreSQL tests need a server on 127.0.0.1:5432 that lets
# user postgres in without a password and has a database `test`. This installs and starts Debian's
# server when none listens; without root or apt-get it says so and those tests skip with a reason.
# It always ends with one line saying what it found or did.
set -u
PORT=5432
listens() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }
skip() { echo "PostgreSQL not set up ($1): the PostgreSQL tests will skip"; exit 0; }

how="found a server already listening"
if ! listens; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || skip "no server on 127.0.0.1:$PORT; installing one needs root and apt-get"
  if ! command -v pg_lsclusters >/dev/null; then
    echo "installing Debian's PostgreSQL server (apt-get install postgresql) for the PostgreSQL tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null 2>&1 \
      || skip "apt-get install postgresql failed"
    how="installed Debian's server (apt-get install postgresql) and"
  else
    how="found Debian's server installed, not running, and"
  fi
  # the cluster on port 5432 (Debian's install creates `main`), or a new one named workbench
  cluster=$(pg_lsclusters -h | awk -v p=$PORT '$3 == p {print $1, $2; exit}')
  if [ -z "$cluster" ]; then
    version=$(ls /usr/lib/postgresql | sort -V | tail -1)
    pg_createcluster "$version" workbench --port $PORT >/dev/null || skip "pg_createcluster failed"
    cluster="$version workbench"
  fi
  set -- $cluster
  hba=/etc/postgresql/$1/$2/pg_hba.conf
  # the tests log in as postgres over loopback without a password (only this user, only 127.0.0.1)
  grep -q "^host all postgres 127.0.0.1/32 trust" "$hba" || sed -i '1i host all postgres 127.0.0.1/32 trust' "$hba"
  echo "starting PostgreSQL cluster $1/$2 on 127.0.0.1:$PORT (stop it with: pg_ctlcluster $1 $2 stop)"
  pg_ctlcluster "$1" "$2" start >/dev/null 2>&1
  for _ in $(seq 50); do listens && break; sleep 0.2; done
  listens || skip "the server did not start: see /var/log/postgresql/postgresql-$1-$2.log"
  how="$how started cluster $1/$2 (stop it with: pg_ctlcluster $1 $2 stop)"
fi
has_test=$(psql -h 127.0.0.1 -p $PORT -U postgres -w -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" 2>/dev/null)
if [ "$has_test" = 1 ]; then
  db="database test was there"
elif createdb -h 127.0.0.1 -p $PORT -U postgres -w test 2>/dev/null; then
  db="created database test"
else
  echo "PostgreSQL on 127.0.0.1:$PORT ($how) does not let user postgres in without a password or create database test: the PostgreSQL tests will fail"
  exit 0
fi
echo "PostgreSQL for the PostgreSQL tests on 127.0.0.1:$PORT: $how; $db"
exit 0
