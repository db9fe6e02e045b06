# Tether's entry points. The two commands: `make run` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))

# Where the stack keeps its state and which loopback ports it uses; override any of them, e.g.
# `TETHER_KAFKA_PORT=29092 TETHER_KAFKA_CONTROLLER_PORT=29093 make test`.
export TETHER_STATE_DIR ?= $(ROOT)/.state
export TETHER_KAFKA_PORT ?= 9092
# TETHER_KAFKA_CONTROLLER_PORT defaults to TETHER_KAFKA_PORT + 1 (deploy/local/stack.py).
export TETHER_PG_PORT ?= 5432
export TETHER_REDIS_PORT ?= 6379
# The addresses tests and services read, derived from the ports above unless set explicitly.
export TETHER_KAFKA_BOOTSTRAP ?= 127.0.0.1:$(TETHER_KAFKA_PORT)
export TETHER_PG_DSN ?= postgresql://tether@127.0.0.1:$(TETHER_PG_PORT)/tether
export TETHER_REDIS_URL ?= redis://127.0.0.1:$(TETHER_REDIS_PORT)/0
# The local stack runs one broker, so every topic the services and tests declare has one replica
# (services default to 3, for a production cluster: docs/configuration.md).
export TETHER_TOPIC_REPLICATION_FACTOR ?= 1

PYTHON3 ?= python3
STACK := $(PYTHON3) $(ROOT)/deploy/local/stack.py
VENV := $(ROOT)/.venv
PYTEST_ARGS ?=
# `make run` hands over to this script once it exists (the agent demo run).
RUN_DEMO ?= $(ROOT)/deploy/local/run-demo

.PHONY: help setup up down services-down status test run generate bench chaos image

help:
	@echo "make run       set up, start the local stack, run the demo"
	@echo "make test      set up, start the local stack, run every test (PYTEST_ARGS=... to narrow)"
	@echo "make up        start Kafka, PostgreSQL and Redis on 127.0.0.1 (no-op when running)"
	@echo "make down      stop the services 'make run' left running, then what 'make up' started"
	@echo "make services-down  stop only the Tether services 'make run', 'make bench' or 'make chaos' left running"
	@echo "make status    show the stack's processes, addresses, data and logs"
	@echo "make setup     install what is missing (Debian packages, uv, .venv, Kafka jars)"
	@echo "make generate  regenerate code derived from schemas/ and proto/"
	@echo "make bench     start the stack and Tether, measure it under load (BENCH_SCALE=3 for longer; docs/benchmarks.md)"
	@echo "make chaos     runs under SIGKILLs and broker/database restarts, then the invariant check (CHAOS_SECONDS=120)"
	@echo "make image     build the image the helm chart runs with docker or podman (IMAGE=repo:tag)"

setup:
	@$(ROOT)/deploy/local/setup.sh

up: setup
	@$(STACK) up

down: services-down
	@$(STACK) down

# The demo, the bench and the fault run record the PIDs they started in processes.json under
# $(TETHER_STATE_DIR)/demo*/, bench/<time>/ and chaos/<time>/ (each PID's command line is checked
# before it is signalled, so stale records are harmless).
services-down:
	@dirs=(); \
	for f in "$(TETHER_STATE_DIR)"/demo*/processes.json "$(TETHER_STATE_DIR)"/{bench,chaos}/*/processes.json; do \
	  if [ -e "$$f" ]; then dirs+=("$${f%/processes.json}"); fi; \
	done; \
	if [ -x "$(VENV)/bin/python" ] && (( $${#dirs[@]} )); then \
	  cd $(ROOT) && $(VENV)/bin/python -m tether_testing.system stop "$${dirs[@]}"; \
	fi

status:
	@$(STACK) status

test: up
	cd $(ROOT) && $(VENV)/bin/pytest $(PYTEST_ARGS)

run: up
	@if [ -x "$(RUN_DEMO)" ]; then \
	  exec "$(RUN_DEMO)"; \
	else \
	  echo "The local stack is up: Kafka $(TETHER_KAFKA_BOOTSTRAP), PostgreSQL $(TETHER_PG_DSN), Redis $(TETHER_REDIS_URL)."; \
	  echo "No agent demo is wired into 'make run' yet ($(RUN_DEMO) does not exist). Stop the stack with 'make down'."; \
	fi

generate: setup
	cd $(ROOT) && $(VENV)/bin/python -m tether_contracts.codegen
	cd $(ROOT) && $(VENV)/bin/python -m tether_contracts.protogen

# Benchmarks and the fault run (docs/benchmarks.md). Both print one JSON object as their last line.
# `make chaos` restarts the Kafka broker and PostgreSQL of THIS stack (TETHER_STATE_DIR): on a shared
# machine give it a stack of its own, e.g. TETHER_STATE_DIR=/tmp/tether-chaos TETHER_KAFKA_PORT=19092
# TETHER_PG_PORT=15432 TETHER_REDIS_PORT=16379 make chaos.
BENCH_SCALE ?= 1
CHAOS_SECONDS ?= 600

bench: up
	cd $(ROOT) && TETHER_BENCH_SCALE=$(BENCH_SCALE) $(VENV)/bin/python -m tether_bench.bench

chaos: up
	cd $(ROOT) && CHAOS_SECONDS=$(CHAOS_SECONDS) $(VENV)/bin/python -m tether_bench.chaos

# The image deploy/helm/tether deploys (Dockerfile); by default the chart's own image.repository:tag.
IMAGE ?= ghcr.io/tether/tether:0.1.0
CONTAINER_ENGINE ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)

image:
	@if [ -z "$(CONTAINER_ENGINE)" ]; then \
	  echo "make image: no container engine (neither docker nor podman is on PATH); install one or set CONTAINER_ENGINE=/path/to/docker" >&2; \
	  exit 1; \
	fi
	@$(CONTAINER_ENGINE) info >/dev/null 2>&1 || { \
	  echo "make image: $(CONTAINER_ENGINE) is installed but cannot reach its daemon/socket ($(CONTAINER_ENGINE) info fails)" >&2; \
	  exit 1; }
	cd $(ROOT) && $(CONTAINER_ENGINE) build -f Dockerfile -t $(IMAGE) .
