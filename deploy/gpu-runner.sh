#!/usr/bin/env bash
# Keep one ephemeral self-hosted GPU runner registered: register with --ephemeral (GitHub gives the
# runner exactly one job, then removes its registration), run that job, wipe the work folder, and
# register again. No job sees the work folder of another, and a runner never outlives its one job.
# Caches a job writes under the runner user's $HOME (Triton's kernels in ~/.triton, pip's wheels
# and torch's and Triton's files in ~/.cache, CUDA's JIT cache in ~/.nv/ComputeCache) are wiped with
# it, so no job can leave a compiled kernel or a wheel for the next one. Other files under $HOME
# (~/.local, shell startup files) are not: the runner user must own nothing else, as docs/workflows.md says.
#
# docs/workflows.md "Security: the self-hosted GPU runner" says which settings must be in place first (the
# runner group limited to this repository and to gpu-bench.yml on the default branch, approval for
# outside collaborators' workflows). Run it from the folder where the actions/runner release is
# unpacked, as an unprivileged user (a systemd unit with Restart=always keeps it going):
#
#   NSA_RUNNER_ORG=my-org NSA_RUNNER_GROUP=nsa-gpu NSA_RUNNER_LABELS=gpu,sm90 \
#   NSA_RUNNER_ADMIN_TOKEN_FILE=/etc/nsa-runner/token ./gpu-runner.sh
#
# NSA_RUNNER_ADMIN_TOKEN_FILE holds a token that may create registration tokens for the
# organization (a GitHub App with "Self-hosted runners: write" on the organization, or a
# fine-grained PAT with that permission). It is read from a file, never from the command line, and
# never printed. GITHUB_API_URL: https://HOST/api/v3 on GitHub Enterprise Server.
set -euo pipefail

: "${NSA_RUNNER_ORG:?set NSA_RUNNER_ORG to the organization that owns the runner group}"
: "${NSA_RUNNER_GROUP:?set NSA_RUNNER_GROUP to the runner group limited to gpu-bench.yml (docs/workflows.md)}"
: "${NSA_RUNNER_LABELS:?set NSA_RUNNER_LABELS, e.g. gpu,sm90}"
: "${NSA_RUNNER_ADMIN_TOKEN_FILE:?set NSA_RUNNER_ADMIN_TOKEN_FILE to a file holding the admin token}"
api="${GITHUB_API_URL:-https://api.github.com}"
web="${NSA_RUNNER_WEB_URL:-https://github.com}"
test -x ./config.sh && test -x ./run.sh || { echo "gpu-runner.sh: run it in the unpacked actions/runner folder (config.sh, run.sh)" >&2; exit 2; }

registration_token() {
  # The admin token goes to curl on stdin (a header file), so it never shows in `ps`.
  curl --fail --silent --show-error -X POST \
    -H @- "$api/orgs/$NSA_RUNNER_ORG/actions/runners/registration-token" <<HEADERS | python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])'
Accept: application/vnd.github+json
Authorization: Bearer $(cat "$NSA_RUNNER_ADMIN_TOKEN_FILE")
X-GitHub-Api-Version: 2022-11-28
HEADERS
}

# What a job may leave behind: its work folder and the caches under $HOME (see the header).
wipe_job_files() {
  rm -rf ./_work "${HOME:?}/.triton" "${HOME:?}/.cache" "${HOME:?}/.nv/ComputeCache"
}

wipe_job_files # also what a job left before this script last stopped
while true; do
  # Registration tokens expire after an hour: fetch a fresh one for every registration.
  token="$(registration_token)"
  ./config.sh --unattended --ephemeral --replace \
    --url "$web/$NSA_RUNNER_ORG" --token "$token" \
    --runnergroup "$NSA_RUNNER_GROUP" --labels "$NSA_RUNNER_LABELS" \
    --name "$(hostname)-gpu" --work _work
  unset token
  ./run.sh || echo "gpu-runner.sh: run.sh exited $?; registering again" >&2
  # An ephemeral registration ends with its job, but the host keeps the files: wipe them.
  wipe_job_files
  sleep 5
done
