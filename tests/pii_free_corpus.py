"""A PII-free corpus (issue 33): text governance must leave exactly as the target wrote it.

Every false positive here is a wrong training label. Groups: code, configs, lockfiles, git logs,
version strings and changelogs, math word problems, logs with UUIDs, loopback / unspecified /
private addresses and CIDR ranges, hashes and integrity strings, science words that look like
names. `STRICT` groups (code, math) must come through unchanged, every record; the whole corpus
may be altered in at most 3% of its records.
"""

from __future__ import annotations

import hashlib
import random
import uuid

CODE = [
    "def area(r):\n    return 3.14159 * r * r\n\nprint(area(2.5))",
    "for (let i = 0; i < 10; i++) {\n  console.log(i * 1024);\n}",
    "SELECT id, created_at FROM orders WHERE total > 250 ORDER BY created_at DESC LIMIT 100;",
    "import numpy as np\nx = np.linspace(0, 1, 101)\ny = np.sin(2 * np.pi * x)",
    '#include <stdio.h>\nint main(void) { printf("%d\\n", 0x7fffffff); return 0; }',
    "server.listen(8080, '127.0.0.1', () => console.log('listening on http://127.0.0.1:8080'))",
    "app.run(host='0.0.0.0', port=5000, debug=False)",
    'EXPOSE 8000\nCMD ["uvicorn", "main:app", "--host", "0.0.0.0", "--port", "8000"]',
    "const re = /^[a-f0-9]{40}$/; // a git object id\nif (!re.test(sha)) throw new Error('bad sha');",
    "assert sha256(b'abc').hexdigest().startswith('ba7816bf8f01cfea')",
    "class Avogadro:\n    NA = 6.02214076e23  # Avogadro constant, mol^-1\n",
    "def kelvin(c):\n    return c + 273.15  # Celsius to Kelvin",
    "ip = ipaddress.ip_network('10.0.0.0/8')\nassert ipaddress.ip_address('10.1.2.3') in ip",
    "docker run -p 127.0.0.1:6379:6379 redis:7.2.4-alpine",
    "curl -s http://localhost:9090/api/v1/query?query=up | jq '.data.result[0].value[1]'",
    "matrix = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]\nprint(sum(map(sum, matrix)))",
    "if version.parse(torch.__version__) < version.parse('2.1.0'):\n    raise RuntimeError('need torch>=2.1')",  # noqa: E501
    "uuid = '3f0e8a2c-9b1d-4c7e-8f3a-2d6b5e4c1a09'  # fixture id",
    "Newton's second law in code: force = mass * acceleration  # F = m a",
    "h = hashlib.md5(data).hexdigest()  # e.g. 9e107d9d372bb6826bd81d3542a419d6",
]
CONFIGS = [
    "listen_addresses = '127.0.0.1'\nport = 5432\nmax_connections = 200\nshared_buffers = 128MB",
    '[server]\nhost = "0.0.0.0"\nport = 8443\nworkers = 4\ntimeout = 30',
    "allowed_cidrs:\n  - 10.0.0.0/8\n  - 172.16.0.0/12\n  - 192.168.0.0/16\n  - 127.0.0.0/8",
    "nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch lan",
    'resource "aws_vpc" "main" {\n  cidr_block = "10.20.0.0/16"\n}',
    "net.ipv4.ip_forward = 1\nnet.core.somaxconn = 4096\nvm.swappiness = 10",
    "bind 127.0.0.1 ::1\nprotected-mode yes\nport 6379\nmaxmemory 256mb",
    'services:\n  web:\n    image: nginx:1.25.3\n    ports:\n      - "127.0.0.1:8080:80"',
    '[tool.poetry.dependencies]\npython = "^3.11"\nrequests = "2.31.0"\npydantic = ">=2.5,<3"',
    "server {\n  listen 80;\n  server_name _;\n  allow 192.168.1.0/24;\n  deny all;\n}",
]
LOCKFILES = [
    '"node_modules/lodash": {\n  "version": "4.17.21",\n  "resolved": "https://registry.npmjs.org/lodash/-/lodash-4.17.21.tgz",\n'
    '  "integrity": "sha512-v2kDEe57lecTulaDIuNTPy3Ry4gLGJ6Z1O3vE1krgXZNrsQ+LFTGHVxVjcXPs17LhbZVGedAJv8XZ1tvj5FvSg=="\n}',  # noqa: E501
    "certifi==2024.2.2 \\\n    --hash=sha256:0569859f95fc761b18b45ef421b1290a0f65f147e92a1e5eb3e635f9a5e4e66f",  # noqa: E501
    '[[package]]\nname = "idna"\nversion = "3.6"\nsource = { registry = "https://pypi.org/simple" }',
    'react@^18.2.0:\n  version "18.2.0"\n  resolved "https://registry.yarnpkg.com/react/-/react-18.2.0.tgz#555bd98592883255fa00de14f1151a917b5d77d5"',
    "github.com/stretchr/testify v1.8.4 h1:CcVxjf3Q8PM0mHUKJCdn+eZZtm5yQwehR5yeSVQQcUk=",
]
GITLOGS = [
    "commit 9fceb02d0ae598e95dc970b74767f19372d61af8\nDate:   Tue Mar 4 10:12:44 2025 +0100\n\n    fix: handle empty batches (#1423)",  # noqa: E501
    "a1b2c3d Merge pull request #88 from release/v2.4.1\n5e6f7a8 bump version to 2.4.1\n0c9d8e7 ci: pin actions/checkout@v4",  # noqa: E501
    "* 3e4f5a6 (HEAD -> main, tag: v1.12.0) chore(release): 1.12.0\n* 7b8c9d0 feat: add --dry-run",
]
VERSIONS = [
    "## [2.3.1] - 2024-05-17\n### Fixed\n- Crash on startup with Python 3.12.1",
    "Upgrade from 1.9.14 to 1.10.2 fixed the leak; 1.10.3 (2024-06-02) adds ARM builds.",
    "Tested on Ubuntu 22.04.4 LTS, kernel 6.5.0-27-generic, CUDA 12.4.131, driver 550.54.15.",
    "Chrome 124.0.6367.91 and Firefox 125.0.3 both render it; Safari 17.4.1 does not.",
    "openssl 3.0.13 30 Jan 2024 (Library: OpenSSL 3.0.13 30 Jan 2024)",
    "Release 2024.04.1 — build 20240412.3, schema version 17.",
]
MATH = [
    "A train leaves at 14:30 and travels 245 km at 70 km/h. At what time does it arrive?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "What is 1234567 * 89? Show the multiplication step by step.",
    "Compute 6.02214076 × 10^23 × 0.5 and express the result in scientific notation.",
    "The sum of three consecutive integers is 3072. What is the largest?",
    "A phone plan costs $35 per month plus $0.10 per text. Maria sent 412 texts. What is her bill?",
    "Find x if 17x + 4 = 1209.",
    "A rectangle is 127.5 cm by 64.2 cm. What is its area in square metres?",
    "James has 2 048 marbles and gives away 15% of them. How many are left?",
    "Solve for n: 2^n = 1048576.",
    "The population grew from 1,250,000 to 1,487,500. What was the percentage increase?",
    "Kylie's phone number game: she writes 5551234 and reverses its digits. What number does she get?",
    "Avogadro's number is about 6.022e23. How many molecules are in 0.25 mol of water?",
    "A store sells 3 pens for $4.50. How much do 27 pens cost?",
    "If 12 workers build a wall in 9 days, how many days do 18 workers need?",
]
LOGS_FMT = [
    "2024-05-17T12:03:44.512Z INFO request_id={u} status=200 latency_ms=41 path=/api/v1/items",
    "[{u}] worker-3 finished job in 12.84s (rows=18234)",
    "ERROR 2024-06-02 08:15:02,118 trace_id={u} upstream 10.0.3.17:8080 timed out after 30000 ms",
    "kube-proxy: added 172.16.4.0/24 via 10.244.1.1 dev cni0 (pod {u})",
    "GET /healthz 200 0.8ms from 127.0.0.1 req={u}",
    "sshd[2231]: Accepted publickey for deploy from 192.168.1.23 port 52214 ssh2: ED25519 SHA256:{h}",
    "build {u} sha256:{x} pushed to registry.local:5000/app:1.4.2",
    "session {u} opened; listening on [::]:443 and 0.0.0.0:80",
]
PROSE = [
    "Avogadro's law says equal volumes of gases contain equal numbers of molecules.",
    "The Kelvin scale and the Celsius scale differ by 273.15 degrees.",
    "Euler's identity links e, i, pi, 1 and 0.",
    "Bayes' theorem updates a prior with the likelihood of the evidence.",
    "The Fibonacci sequence starts 0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89.",
    "The Doppler effect explains why a siren sounds higher as it approaches.",
    "Run the migration on staging first; production follows after the 2.4 release.",
    "Schrödinger's equation describes how the quantum state of a system changes over time.",
]

STRICT = ("code", "math")


def pii_free_corpus(seed: int = 33) -> list[tuple[str, str]]:
    """(group, text) pairs; logs get fresh UUIDs and hashes from `seed`."""
    rng = random.Random(seed)
    logs = []
    for i in range(3):
        for fmt in LOGS_FMT:
            u = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            x = hashlib.sha256(f"{seed}-{i}-{fmt}".encode()).hexdigest()
            h = hashlib.sha256(u.encode()).digest().hex()[:43]
            logs.append(fmt.format(u=u, x=x, h=h))
    groups = {
        "code": CODE,
        "config": CONFIGS,
        "lockfile": LOCKFILES,
        "gitlog": GITLOGS,
        "version": VERSIONS,
        "math": MATH,
        "log": logs,
        "prose": PROSE,
    }
    return [(g, t) for g, texts in groups.items() for t in texts]
