#!/usr/bin/env bash
# Make sure Postgres and RabbitMQ answer where drain's tests, demo and
# benchmarks expect them. Quiet and idempotent when both are up.
#
# Addresses (defaults in brackets):
#   DRAIN_PG_HOST [127.0.0.1]    DRAIN_PG_PORT [5432]
#   DRAIN_AMQP_HOST [127.0.0.1]  DRAIN_AMQP_PORT [5672]
#   DRAIN_SERVICES_TIMEOUT [60]  seconds to wait for a started service to answer
#
# For each service that does not answer, in this order:
#   1. start the copy installed on this machine
#      (pg_ctlcluster for every cluster under /etc/postgresql; rabbitmq-server -detached);
#   2. if none is installed and we are root with apt-get: install it, start it
#      (and, for a fresh Postgres, allow trust auth from 127.0.0.1);
#   3. if a Docker engine answers: docker compose -f deploy/docker-compose.yml up -d;
#   4. otherwise print what is missing and exit 1.
# Never reads stdin; safe under CI=true.

# Functions named "${service}_answers" etc. are called indirectly, and the
# single-quoted script in probe() expands in its own shell, on purpose.
# shellcheck disable=SC2016,SC2329
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
COMPOSE_FILE="$ROOT/deploy/docker-compose.yml"
PG_HOST=${DRAIN_PG_HOST:-127.0.0.1}
PG_PORT=${DRAIN_PG_PORT:-5432}
AMQP_HOST=${DRAIN_AMQP_HOST:-127.0.0.1}
AMQP_PORT=${DRAIN_AMQP_PORT:-5672}
TIMEOUT=${DRAIN_SERVICES_TIMEOUT:-60}
export DEBIAN_FRONTEND=noninteractive
exec </dev/null

say() { printf '%s\n' "$*"; }

# -- probes ---------------------------------------------------------------------

# A bare TCP connect is not enough: some networks run a proxy that accepts any
# connection. Each probe sends the protocol's first bytes and checks the reply.
probe() {  # host port request reply-pattern
    timeout 4 bash -c '
        exec 3<>"/dev/tcp/$0/$1" || exit 1
        printf "$2" >&3
        LC_ALL=C IFS= read -r -t 3 -N 1 -d "" reply <&3 || exit 1
        [[ $reply == $3 ]]' "$1" "$2" "$3" "$4" 2>/dev/null
}

postgres_answers() {
    if command -v pg_isready >/dev/null; then
        # 0: accepting connections; 1: up but refusing (e.g. still starting).
        pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 3
    else
        # SSLRequest; a Postgres server answers S or N.
        probe "$PG_HOST" "$PG_PORT" '\x00\x00\x00\x08\x04\xd2\x16\x2f' '[SN]'
    fi
}

# The AMQP 0-9-1 protocol header; RabbitMQ answers with a method frame (type 1).
rabbitmq_answers() { probe "$AMQP_HOST" "$AMQP_PORT" 'AMQP\x00\x00\x09\x01' $'\x01'; }

wait_until_answers() {  # service: poll until it answers or the deadline passes
    local service=$1 deadline=$((SECONDS + TIMEOUT))
    until "${service}_answers"; do
        if ((SECONDS >= deadline)); then
            return 1
        fi
        sleep 0.5
    done
}

is_local() {
    case $1 in 127.* | localhost | ::1 | "${HOSTNAME:-localhost}") return 0 ;; *) return 1 ;; esac
}

# -- ways of starting a service ---------------------------------------------------

postgres_installed() {
    command -v pg_ctlcluster >/dev/null && compgen -G '/etc/postgresql/*/main' >/dev/null
}

rabbitmq_installed() { command -v rabbitmq-server >/dev/null; }

start_installed_postgres() {  # fails only when no cluster could be started
    local dir version out started=1
    for dir in /etc/postgresql/*/main; do
        version=$(basename "$(dirname "$dir")")
        if out=$(pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>&1); then
            started=0
        elif [[ $out == *"already running"* ]]; then  # exit status 2
            started=0
        else
            say "postgres: pg_ctlcluster $version main start failed: ${out//$'\n'/ }"
        fi
    done
    return "$started"
}

# RabbitMQ keeps a file open per queue it writes to; with fewer descriptors than
# queues, its queues wait on each other for a file handle (the broker logs "Please
# increase max open file handles limit"). Its production guide asks for 65,536 or
# more; run as root, Debian's rabbitmq-server goes through su, whose PAM limits
# give it 1,024. At 10,000 queues that made the drain 10 x slower (docs/performance.md).
RABBITMQ_NOFILE=65536
RABBITMQ_NOFILE_WARN=10000  # a running local broker below this gets a note

start_installed_rabbitmq() {
    local log=${TMPDIR:-/tmp}/drain-rabbitmq-start.log nofile
    nofile=$(ulimit -Hn)
    if [[ $nofile == unlimited ]] || ((nofile > RABBITMQ_NOFILE)); then
        nofile=$RABBITMQ_NOFILE
    fi
    # -detached returns at once; the broker needs 10-20 s before it answers.
    if ! (ulimit -n "$nofile" 2>/dev/null; as_rabbitmq rabbitmq-server -detached) >"$log" 2>&1
    then
        say "rabbitmq: rabbitmq-server -detached failed (see $log)"
        return 1
    fi
}

as_rabbitmq() {  # command...: as root, as the rabbitmq user without su, so the limit holds
    if [[ $(id -u) == 0 ]] && id -u rabbitmq >/dev/null 2>&1 && command -v setpriv >/dev/null
    then
        cd /var/lib/rabbitmq \
            && HOME=/var/lib/rabbitmq setpriv --reuid rabbitmq --regid rabbitmq --init-groups "$@"
    else
        "$@"
    fi
}

# A local broker started some other way: say so when it has few file descriptors.
warn_rabbitmq_nofile() {
    local pid limit
    pid=$(pgrep -o -f 'beam.*rabbit' 2>/dev/null) || return 0
    limit=$(awk '/^Max open files/ {print $4}' "/proc/$pid/limits" 2>/dev/null) || return 0
    if [[ $limit =~ ^[0-9]+$ ]] && ((limit < RABBITMQ_NOFILE_WARN)); then
        say "rabbitmq: note: the broker may open only $limit files (soft limit); with more" \
            "queues than that it slows down. RabbitMQ asks for $RABBITMQ_NOFILE or more."
    fi
}

APT_UPDATED=0
apt_install() {  # package
    if ((APT_UPDATED == 0)); then
        apt-get update -q >/dev/null
        APT_UPDATED=1
    fi
    apt-get install -y -q --no-install-recommends "$1" >/dev/null
}

can_apt_install() { [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; }

trust_local_postgres() {  # a fresh cluster: let 127.0.0.1 and ::1 in without a password
    local hba dir
    for hba in /etc/postgresql/*/main/pg_hba.conf; do
        if ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
            sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
        fi
    done
    for dir in /etc/postgresql/*/main; do
        pg_ctlcluster --skip-systemctl-redirect "$(basename "$(dirname "$dir")")" main reload \
            >/dev/null 2>&1 || true
    done
}

docker_compose() {
    if docker compose version >/dev/null 2>&1; then
        docker compose "$@"
    elif command -v docker-compose >/dev/null; then
        docker-compose "$@"
    else
        return 127
    fi
}

docker_available() {
    command -v docker >/dev/null && docker info >/dev/null 2>&1 \
        && { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }
}

# -- one service ---------------------------------------------------------------------

ensure() {  # service host port apt-package
    local service=$1 host=$2 port=$3 package=$4 tried=()
    if "${service}_answers"; then
        say "$service: already answering at $host:$port"
        return 0
    fi
    if ! is_local "$host"; then
        say "$service: not answering at $host:$port, which is not this machine; start it there"
        return 1
    fi

    if "${service}_installed"; then
        if ! "start_installed_$service"; then
            tried+=("could not start the installed server")
        elif wait_until_answers "$service"; then
            say "$service: started the installed server; answering at $host:$port"
            return 0
        else
            tried+=("the installed server was started but did not answer here within ${TIMEOUT}s")
        fi
    elif can_apt_install; then
        say "$service: not installed; installing $package with apt-get"
        if apt_install "$package"; then
            if [[ $service == postgres ]]; then
                trust_local_postgres
            fi
            if "start_installed_$service" && wait_until_answers "$service"; then
                say "$service: installed and started $package; answering at $host:$port"
                return 0
            fi
            tried+=("freshly installed $package did not answer within ${TIMEOUT}s")
        else
            tried+=("apt-get install $package failed")
        fi
    else
        tried+=("not installed, and cannot apt-get install it (needs root and apt-get)")
    fi

    if docker_available; then
        say "$service: starting it with docker compose ($COMPOSE_FILE)"
        if docker_compose -f "$COMPOSE_FILE" up -d "$service" && wait_until_answers "$service"; then
            say "$service: started with docker compose; answering at $host:$port"
            return 0
        fi
        tried+=("docker compose did not bring it up")
    else
        tried+=("no Docker engine with compose answers")
    fi

    local why
    why=$(printf '%s; ' "${tried[@]}")
    say "$service: MISSING: nothing answers at $host:$port (${why%; })" >&2
    return 1
}

status=0
ensure postgres "$PG_HOST" "$PG_PORT" postgresql || status=1
ensure rabbitmq "$AMQP_HOST" "$AMQP_PORT" rabbitmq-server || status=1
if is_local "$AMQP_HOST"; then
    warn_rabbitmq_nofile
fi

# -- Spark (drain backfill / reconcile, tests/spark): Java and the Postgres JDBC jar -----
# Optional: never fails this script. Without Java the Spark tests skip; without the
# jar the JDBC ones skip, each saying why.
JDBC_JAR=${DRAIN_SPARK_JDBC_JAR:-/usr/share/java/postgresql.jar}
if command -v java >/dev/null; then
    say "java: $(java -version 2>&1 | head -n 1)"
else
    say "java: MISSING: Spark needs Java 17+ (e.g. apt-get install openjdk-17-jre-headless)"
fi
if [[ -f $JDBC_JAR ]]; then
    say "jdbc: $JDBC_JAR present"
elif can_apt_install && [[ -z ${DRAIN_SPARK_JDBC_JAR:-} ]]; then
    say "jdbc: $JDBC_JAR missing; installing libpostgresql-jdbc-java with apt-get"
    if apt_install libpostgresql-jdbc-java && [[ -f $JDBC_JAR ]]; then
        say "jdbc: installed $JDBC_JAR"
    else
        say "jdbc: apt-get install libpostgresql-jdbc-java failed; the Spark JDBC tests will skip"
    fi
else
    say "jdbc: $JDBC_JAR missing (install libpostgresql-jdbc-java as root, or set" \
        "DRAIN_SPARK_JDBC_JAR); the Spark JDBC tests will skip"
fi

# -- promtool (tests/unit/test_alerts.py): Debian's prometheus package ships it -----------
# Optional: never fails this script. Without promtool those tests skip, saying why, where
# it cannot be installed (no root or apt-get), and fail where it could. The package must
# not leave a Prometheus server running: while apt installs it, a policy-rc.d answering
# 101 (Debian's "action forbidden") keeps invoke-rc.d and deb-systemd-invoke from starting
# the service, and afterwards nothing may answer on :9090 that did not answer before.
prometheus_listening() { probe 127.0.0.1 9090 'GET /-/ready HTTP/1.0\r\n\r\n' 'H'; }

# apt-get install PACKAGE with a policy-rc.d answering 101 in place (unless one exists), so
# that invoke-rc.d and deb-systemd-invoke start none of its services while apt runs.
apt_install_no_start() {  # package
    local policy=/usr/sbin/policy-rc.d ours=0 ok=0
    if [[ ! -e $policy ]]; then
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
        printf '#!/bin/sh\n# drain ensure-services.sh: no service starts while apt runs\nexit 101\n' \
            >"$policy"
        chmod 755 "$policy"
        ours=1
    fi
    apt_install "$1" || ok=1
    if ((ours)); then
        rm -f "$policy"
        trap - EXIT
    fi
    return "$ok"
}

install_promtool() {
    local was_listening=0 ok=0
    if prometheus_listening; then
        was_listening=1
    fi
    apt_install_no_start prometheus || ok=1
    if ((was_listening == 0)) && prometheus_listening; then
        say "promtool: the prometheus package started a server on :9090; stopping it"
        invoke-rc.d prometheus stop >/dev/null 2>&1 || service prometheus stop >/dev/null 2>&1 \
            || systemctl stop prometheus >/dev/null 2>&1 || true
    fi
    return "$ok"
}

if command -v promtool >/dev/null; then
    say "promtool: $(promtool --version 2>&1 | head -n 1)"
elif can_apt_install; then
    say "promtool: missing; installing Debian's prometheus package with apt-get"
    if install_promtool && command -v promtool >/dev/null; then
        say "promtool: installed $(promtool --version 2>&1 | head -n 1)"
    else
        say "promtool: apt-get install prometheus failed; tests/unit/test_alerts.py will fail"
    fi
else
    say "promtool: MISSING (install Debian's prometheus package as root); the alert rule" \
        "tests will skip"
fi

# optional_command COMMAND PACKAGE WHAT: say COMMAND's version, or install Debian's PACKAGE
# when root can; never fails this script (WHAT, the tests that need it, skip without it).
optional_command() {
    local command=$1 package=$2 what=$3
    if command -v "$command" >/dev/null; then
        say "$command: $("$command" --version 2>/dev/null | head -n 1)"
    elif can_apt_install; then
        say "$command: missing; installing Debian's $package package with apt-get"
        if apt_install "$package" && command -v "$command" >/dev/null; then
            say "$command: installed $("$command" --version 2>/dev/null | head -n 1)"
        else
            say "$command: apt-get install $package failed; $what will skip"
        fi
    else
        say "$command: MISSING (install Debian's $package package as root); $what will skip"
    fi
}

# -- chromium (tests/acceptance/test_status_page.py): Debian's chromium, run headless -------
# Optional: never fails this script; without it the status page test skips, saying why (and
# fails under CI=true where root could have installed it). Its fonts come with it
# (fontconfig-config depends on fonts-dejavu-core or another font package).
optional_command chromium chromium "the status page test"

# -- pgbouncer (tests/acceptance/test_pgbouncer.py): Debian's pgbouncer package ------------
# Optional: never fails this script; without it those tests skip, saying why (and fail under
# CI=true where root could have installed it). Only the binary is wanted: the tests start
# PgBouncers of their own on free ports. The package's service must neither start while apt
# installs it (a policy-rc.d answering 101, as for prometheus) nor at boot (disabled
# afterwards); if it started anyway, nothing of it may be left answering on :6432.
pgbouncer_binary() {
    command -v pgbouncer || { [[ -x /usr/sbin/pgbouncer ]] && echo /usr/sbin/pgbouncer; }
}

pgbouncer_listening() { probe 127.0.0.1 6432 '\x00\x00\x00\x08\x04\xd2\x16\x2f' '[SN]'; }

install_pgbouncer() {
    local was_listening=0 ok=0
    if pgbouncer_listening; then
        was_listening=1
    fi
    apt_install_no_start pgbouncer || ok=1
    if command -v systemctl >/dev/null; then
        systemctl disable pgbouncer >/dev/null 2>&1 || true
    fi
    if command -v update-rc.d >/dev/null; then
        update-rc.d pgbouncer disable >/dev/null 2>&1 || true
    fi
    if ((was_listening == 0)) && pgbouncer_listening; then
        say "pgbouncer: the package started its service on :6432; stopping it"
        invoke-rc.d pgbouncer stop >/dev/null 2>&1 || service pgbouncer stop >/dev/null 2>&1 \
            || systemctl stop pgbouncer >/dev/null 2>&1 || true
    fi
    return "$ok"
}

if PGBOUNCER=$(pgbouncer_binary); then
    say "pgbouncer: $("$PGBOUNCER" --version 2>&1 | head -n 1)"
elif can_apt_install; then
    say "pgbouncer: missing; installing Debian's pgbouncer package with apt-get"
    if install_pgbouncer && PGBOUNCER=$(pgbouncer_binary); then
        say "pgbouncer: installed $("$PGBOUNCER" --version 2>&1 | head -n 1)"
    else
        say "pgbouncer: apt-get install pgbouncer failed; the PgBouncer tests will skip"
    fi
else
    say "pgbouncer: MISSING (install Debian's pgbouncer package as root); the PgBouncer" \
        "tests will skip"
fi

# -- iptables (tests/rabbit_cluster, make test-rabbit-cluster): Debian's iptables ---------
# Optional: never fails this script; the three-node RabbitMQ cluster tests cut one node off
# with it (a partition), and skip without it, saying why.
optional_command iptables iptables "the cluster tests"

exit "$status"
