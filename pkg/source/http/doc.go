// Package httpsource resolves http:// and https:// references: a single
// file pinned by digest ("…/model.bin#sha256:…"), or a Manifest (weightd's
// JSON list of a model's files and their sha256) whose files it reads with
// ranged GETs. Its name is httpsource, not http, so that it and net/http can
// be used in one file without renaming either; the folder is pkg/source/http.
//
// Authentication: none of its own; whatever the client given to New adds
// (presigned URLs carry theirs in the query, which errors never show).
//
// Permanent: 4xx other than 408, 425 and 429, a manifest that does not
// parse or exceeds MaxManifestSize or MaxManifestFiles, a server that
// reports another size than the one pinned.
package httpsource
