// Package api is the agent's local HTTP API, server and client.
//
// The agent serves it on a unix socket (or a loopback TCP port) for the
// weightd CLI, init containers and node-local tools:
//
//	POST /v1/fetch            {"ref": "..."} → 202 and the job's status
//	GET  /v1/fetch            every job's status
//	GET  /v1/fetch/{id}       one job's status
//	GET  /v1/fetch/{id}/watch the job's status as NDJSON, one line per change, until it ends
//	GET  /v1/status           version, cache usage, jobs, peers, GPUs, warm servers and model loads
//	POST /v1/adapters         {"base": "...", "ref": "..."} → where the LoRA adapter is served, once loaded
//	GET  /healthz, /readyz    liveness and readiness
//
// Errors, including an unknown route (404) and a wrong method (405), are JSON
// objects {"error": "message"} with a 4xx or 5xx status.
package api
