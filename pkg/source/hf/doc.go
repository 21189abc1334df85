// Package hf resolves hf:// references against a Hugging Face hub (or a
// mirror of its API): the commit a revision names, the repository's tree at
// that commit, LFS files read later with ranged GETs through the hub's
// redirects, small git-stored files read and checked while resolving. With
// WithShared, a peer's listing of a commit stands in for the hub's.
//
// Authentication: an optional bearer token (HF_TOKEN), sent only to the
// endpoint's own origin, never to the CDN a download is redirected to, and
// only for the requesters source.AgentCredentials allows.
//
// Permanent: 4xx other than 408, 425 and 429 (the hub's X-Error-Code says
// why), listings that break the hub's own rules or the limits here, and
// files whose size disagrees with the listing.
package hf
