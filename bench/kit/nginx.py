"""nginx in front of mock upstreams, on a loopback port: the reference hop of the benchmarks
(`overhead`, `hop`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tests.support.harness import Cluster, Proc, free_port, wait_http


def nginx_conf(port: int, upstreams: list[int], tmp: Path) -> Path:
    servers = "\n".join(f"    server 127.0.0.1:{p};" for p in upstreams)
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/f; uwsgi_temp_path {tmp}/u; scgi_temp_path {tmp}/s;
  upstream mock {{
{servers}
    keepalive 512;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
""")
    return conf


def start_nginx(cluster: Cluster, ups: list[Proc]) -> Proc | None:
    """nginx in front of `ups` (None when it is not installed)."""
    binary = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if binary is None:
        return None
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="sluicegate-nginx-", dir=cluster.tmp))
    conf = nginx_conf(port, [u.port for u in ups], tmp)
    proc = cluster._spawn([binary, "-c", str(conf), "-p", str(tmp)], port, "nginx", None)
    wait_http(f"http://127.0.0.1:{port}/health", proc=proc.popen)
    return proc
