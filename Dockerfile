# The image deploy/helm/tether runs: the whole workspace (every service's package) in one venv;
# each workload starts its service with `python -m <module>` (services.<name>.module).
#   make image                      # docker or podman; IMAGE=ghcr.io/tether/tether:0.1.0 by default
# Runs as UID 10001 with a read-only root filesystem: the only writable place is /tmp (the chart
# mounts an emptyDir there), so HOME and TMPDIR point at it and no bytecode is written at run time.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: the locked, non-dev dependencies of the workspace --------------------------------------
FROM ${PYTHON_IMAGE} AS build
# The uv deploy/local/setup.sh pins (UV_VERSION), from PyPI.
ARG UV_VERSION=0.13.9
RUN pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}"
# The venv sits at the same path in both stages (its scripts and python link are absolute).
ENV UV_PROJECT_ENVIRONMENT=/opt/tether/venv \
    UV_PYTHON_DOWNLOADS=never \
    UV_PYTHON=/usr/local/bin/python3.11 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy
WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY libs libs
COPY services services
COPY bench bench
# --frozen: exactly uv.lock, refused if it is stale; --no-dev: no test tools; --no-editable: the
# workspace packages are installed into the venv, so /src is not needed at run time.
RUN uv sync --frozen --no-dev --no-editable

# -- runtime ---------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# bubblewrap: the tool-gateway's `sandbox` / `mcp_stdio` executors (probed at start-up; without it
# those tools fail with EXECUTOR_UNAVAILABLE).
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 tether \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tether
COPY --from=build /opt/tether/venv /opt/tether/venv
ENV PATH=/opt/tether/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/tether/venv \
    HOME=/tmp \
    TMPDIR=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# The chart sets args per workload; this default only shows the image works.
CMD ["python", "-c", "import tether_run_api, tether_planner, tether_tool_gateway, tether_approval, tether_budget, tether_projector"]
