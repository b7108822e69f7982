#!/usr/bin/env bash
# A local PostgreSQL for the MLflow tracking server (`moe mlflow-server`): starts Debian's
# default cluster and creates role and database "mlflow" (password "mlflow"), listening on
# 127.0.0.1:5432 only. Needs root and Debian's postgresql package. Idempotent.
set -euo pipefail
ver=$(ls /usr/lib/postgresql | sort -V | tail -1)
if ! pg_lsclusters -h | grep -q "^$ver *main"; then
  pg_createcluster "$ver" main >/dev/null
fi
pg_ctlcluster "$ver" main start 2>/dev/null || true
for _ in $(seq 1 30); do
  runuser -u postgres -- pg_isready -q -h 127.0.0.1 && break
  sleep 1
done
runuser -u postgres -- psql -q -tc "SELECT 1 FROM pg_roles WHERE rolname='mlflow'" | grep -q 1 \
  || runuser -u postgres -- psql -q -c "CREATE ROLE mlflow LOGIN PASSWORD 'mlflow'"
runuser -u postgres -- psql -q -tc "SELECT 1 FROM pg_database WHERE datname='mlflow'" | grep -q 1 \
  || runuser -u postgres -- psql -q -c "CREATE DATABASE mlflow OWNER mlflow"
# The password goes to `moe mlflow-server` through the environment (or --password-file), never argv.
echo "export MOE_MLFLOW_BACKEND=postgresql+psycopg2://mlflow@127.0.0.1:5432/mlflow MOE_MLFLOW_BACKEND_PASSWORD=mlflow"
