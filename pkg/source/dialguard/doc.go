// Package dialguard keeps the agent's fetches for references a pod names
// off the addresses a pod must not reach through it: loopback, link-local,
// cloud metadata and the node's own interfaces (see Guard). The agent's
// four sources dial through one Guard; refusals wrap ErrAddressRefused and
// are permanent.
package dialguard
