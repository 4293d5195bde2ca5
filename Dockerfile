# sluicegate container image: the router's CLI as entrypoint, run as a non-root user.
#   docker build -t sluicegate .
#   docker run --read-only --tmpfs /tmp --stop-timeout 40 -p 8080:8080 \
#     -v $PWD/config.yaml:/etc/sluicegate/config.yaml:ro sluicegate
# (--stop-timeout: longer than the config's drain_grace, 30 s by default; docker's own is 10 s.)
#
# The base, pinned by digest so a rebuild gets the same one: python:3.12-slim-bookworm
# (Python 3.12.14), as the Docker Official Images published it. Another base or a newer digest:
#   docker build --build-arg BASE_IMAGE=python:3.11-slim-bookworm .
ARG BASE_IMAGE=python:3.12-slim-bookworm@sha256:0f5b26b9518d002b6173fd61daad821fa340635ebfec5bba471013f9ca114579

# Build stage: a virtualenv, installed from the hash-pinned locks (`make lock` writes them from
# pyproject.toml), copied whole into the final image.
FROM ${BASE_IMAGE} AS build
# Empty unless the build machine's HTTPS goes through a proxy with its own CA: then the path,
# inside the base, of a CA bundle that trusts it.
ARG PIP_CERT=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
WORKDIR /src
COPY requirements.lock requirements-build.lock ./
# pip and the build backend live in a throwaway venv; the router's venv never has an installer
# (`venv --without-pip`: on 3.11 a venv would otherwise also get setuptools). Every file is
# checked against the lock's hashes, and a dependency missing from the lock fails the build.
RUN python -m venv --without-pip /opt/build \
 && python -m pip --python /opt/build/bin/python install -q --require-hashes --only-binary :all: \
      -r requirements-build.lock \
 && python -m venv --without-pip /opt/sluicegate \
 && /opt/build/bin/python -m pip --python /opt/sluicegate/bin/python install -q \
      --require-hashes --only-binary :all: -r requirements.lock
COPY pyproject.toml README.md ./
COPY router ./router
COPY balancers ./balancers
COPY health ./health
# The router's own wheel, built offline by the locked backend, without its dependencies (the lock
# installed them); `pip check` fails the build if the lock does not satisfy pyproject.toml.
# Bytecode compiled now (the root filesystem is read-only at run time), checked against nothing
# at import (`unchecked-hash`: the image never changes, and the bytes do not depend on mtimes).
RUN /opt/build/bin/python -m pip wheel -q --no-deps --no-build-isolation --no-index -w /tmp/dist . \
 && /opt/build/bin/python -m pip --python /opt/sluicegate/bin/python install -q --no-deps \
      --no-index /tmp/dist/*.whl \
 && /opt/build/bin/python -m pip --python /opt/sluicegate/bin/python check \
 && /opt/sluicegate/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash \
      /opt/sluicegate

# Final stage: the same base (the venv's interpreter), no compilers, no pip cache, no source.
FROM ${BASE_IMAGE}
# The base's installers go (pip; on 3.11 also setuptools and wheel, and ensurepip's copies of
# them): nothing installs packages at run time, and scanners flag them. Then the standard
# library's bytecode, which the official base deletes: on a read-only root every start and every
# health probe would compile it again (import 0.84 s instead of 0.46 s).
RUN set -eu; \
    stdlib="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"; \
    if python -c 'import pip' 2>/dev/null; then \
      python -m pip uninstall -q -y --disable-pip-version-check pip setuptools wheel 2>/dev/null; \
    fi; \
    rm -f "$stdlib"/ensurepip/_bundled/*.whl; \
    python -m compileall -q -j 0 --invalidation-mode unchecked-hash \
      -x '/(idlelib|tkinter|turtledemo|lib2to3|ensurepip)/' "$stdlib"; \
    groupadd --system --gid 10001 sluicegate; \
    useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin sluicegate
COPY --from=build /opt/sluicegate /opt/sluicegate
ENV PATH=/opt/sluicegate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLUICEGATE_HOST=0.0.0.0 \
    SLUICEGATE_PORT=8080 \
    SLUICEGATE_CONFIG=/etc/sluicegate/config.yaml
USER 10001:10001
EXPOSE 8080
# Probes the address the router listens on (--host/--port of the command, else SLUICEGATE_HOST/
# SLUICEGATE_PORT): router/tools/probe.py, standard library only.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
  CMD ["python", "-m", "router.tools.probe"]
ENTRYPOINT ["sluicegate"]
CMD ["serve"]
