#!/usr/bin/env bash
# Certificates for a test setup of TLS and mutual TLS (docs/security.md), with openssl:
#   scripts/make-certs.sh DIR [CLIENT_NAME ...]
# writes DIR/ca.pem (a new CA, valid 30 days), DIR/server.crt and DIR/server.key (for localhost and
# 127.0.0.1; set SERVER_NAMES="DNS:host,IP:10.0.0.5" for others) and, for each CLIENT_NAME, DIR/NAME.crt and
# DIR/NAME.key (CN=NAME: list it in a tenant's "subjects" to name that tenant by certificate). Keys are
# mode 600. For production, use your organisation's CA.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 DIR [CLIENT_NAME ...]" >&2
  exit 2
fi
dir=$1
shift
names=${SERVER_NAMES:-DNS:localhost,IP:127.0.0.1}
mkdir -p "$dir"
umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key "$dir/ca.key"
openssl req -x509 -new -key "$dir/ca.key" -sha256 -days 30 -subj "/CN=chunkattn test CA" \
  -addext "basicConstraints=critical,CA:TRUE,pathlen:0" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out "$dir/ca.pem"

issue() {  # NAME CN EXTENSIONS
  key "$dir/$1.key"
  openssl req -new -key "$dir/$1.key" -subj "/CN=$2" -out "$tmp/$1.csr"
  printf '%s\n' "$3" > "$tmp/$1.ext"
  openssl x509 -req -in "$tmp/$1.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -CAserial "$tmp/ca.srl" -days 30 -sha256 -extfile "$tmp/$1.ext" -out "$dir/$1.crt" 2>/dev/null
}

issue server "chunkattn server" "subjectAltName=$names
extendedKeyUsage=serverAuth"
for client in "$@"; do
  issue "$client" "$client" "extendedKeyUsage=clientAuth"
done
chmod 644 "$dir"/*.crt "$dir/ca.pem"
echo "wrote $dir: ca.pem (trust it in clients), server.crt and server.key (--tls-cert, --tls-key)${*:+, and a certificate and key for each of: $*}"
