# sluicegate container image: the router's CLI as entrypoint, run as a non-root user.
#   docker build -t sluicegate .
#   docker run -p 8080:8080 -v $PWD/backends.yaml:/etc/sluicegate/config.yaml:ro sluicegate
ARG PYTHON_VERSION=3.12

# Build stage: install into a virtualenv that is copied whole into the final image.
FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/sluicegate
COPY pyproject.toml README.md ./
COPY router ./router
COPY balancers ./balancers
COPY health ./health
# Bytecode compiled now: the root filesystem is read-only at run time.
RUN /opt/sluicegate/bin/pip install . \
 && /opt/sluicegate/bin/pip uninstall -y pip \
 && /opt/sluicegate/bin/python -m compileall -q /opt/sluicegate

# Final stage: the same slim base (the venv's interpreter), no compilers, no pip cache, no source.
FROM python:${PYTHON_VERSION}-slim
RUN groupadd --system --gid 10001 sluicegate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
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
HEALTHCHECK --interval=10s --timeout=3s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
ENTRYPOINT ["sluicegate"]
CMD ["serve"]
