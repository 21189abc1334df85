// Package fetch is what the sources under pkg/source share to read an
// origin over HTTP: Client (requests with weightd's User-Agent and errors
// without the URL's query), Blob (a ranged reader of a blob of known size,
// with CheckRange for the responses), StatusError for unexpected statuses,
// and Truncate and Sanitize for text that comes from the network.
package fetch
