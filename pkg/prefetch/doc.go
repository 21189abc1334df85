// Package prefetch brings models onto the node before anything asks for them:
// it parses model references, resolves them through sources to files named by
// digest, and runs the fetch queue that downloads those files into the cache
// and materialises them as model directories.
//
// # References
//
// A reference names a model or a single file where it can be fetched from
// (see ParseRef). Today that is plain HTTP(S):
//
//	https://host/path/model.json                  a model manifest (see Manifest)
//	https://host/path/file.bin#sha256:<64 hex>    one file pinned by its digest
//
// # Sources
//
// A Source turns a Ref into a Resolution: the model's files (path, digest,
// size) and, for each blob, a cache.RangeOpener that reads it from the origin
// starting at any offset. Sources stay small: they open ranges and classify
// errors (cache.Permanent for what retrying cannot fix). Retries, resume,
// stall detection and verification live in the cache.
//
// # The queue
//
// A Queue takes references (Submit), deduplicates concurrent requests for the
// same reference, runs a bounded number of jobs at a time, each fetching a
// bounded number of files at a time (largest first), then materialises the
// model and reports its directory. Jobs stream their progress to watchers.
package prefetch
