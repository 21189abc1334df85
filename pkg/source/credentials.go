package source

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// AnyNamespace, in an AgentCredentials rule, lets every requester use the
// agent's credentials for that source: pods of any namespace, and clients of
// the registry mirror, whose namespace the agent cannot know.
const AnyNamespace = "*"

// UnknownNamespace is the requester of a registry mirror request: a pod of
// some namespace that the request does not tell. Only an AnyNamespace rule
// lets it use the agent's credentials.
const UnknownNamespace = "?"

// AgentCredentials says for whom the agent's own credentials (the hub
// token, its Docker config and pull secrets, its AWS credentials) may be
// used, per source: the
// operator's own requests (the CLI, the local API, PrefetchPolicies) always
// may; a pod's only where a rule names its source and its namespace. The
// zero value lets only the operator use them: a pod that names a private
// repository the agent could read gets what an anonymous client gets.
type AgentCredentials struct {
	rules map[string][]string // source host → namespaces
}

// ParseAgentCredentials parses rules of the form "HOST=NS[;NS…]": HOST is a
// registry host[:port] ("docker.io" for Docker Hub), the hub's host, or
// "s3://BUCKET" for one bucket of the S3 source; NS a namespace or
// AnyNamespace. A host given twice has the union of its namespaces.
func ParseAgentCredentials(specs []string) (AgentCredentials, error) {
	a := AgentCredentials{rules: make(map[string][]string)}
	for _, spec := range specs {
		host, nss, ok := strings.Cut(strings.TrimSpace(spec), "=")
		h := credentialHost(host)
		valid := ref.ValidRegistry(h)
		if bucket, isS3 := strings.CutPrefix(h, "s3://"); isS3 {
			// Per bucket, not per endpoint: the agent's role may read
			// many buckets, and a namespace should get only its own.
			valid = ref.CheckS3Bucket(bucket) == nil
		}
		if !ok || !valid {
			return AgentCredentials{}, fmt.Errorf("%w: agent credentials rule %q: want HOST=NAMESPACE[;NAMESPACE…] (HOST a registry or hub host[:port], or s3://BUCKET)", content.ErrInvalid, fetch.Truncate(spec))
		}
		for ns := range strings.SplitSeq(nss, ";") {
			ns = strings.TrimSpace(ns)
			if ns != AnyNamespace && !namespaceRE.MatchString(ns) {
				return AgentCredentials{}, fmt.Errorf("%w: agent credentials rule %q: %q is not a namespace or %q", content.ErrInvalid, fetch.Truncate(spec), fetch.Truncate(ns), AnyNamespace)
			}
			if !slices.Contains(a.rules[h], ns) {
				a.rules[h] = append(a.rules[h], ns)
			}
		}
	}
	return a, nil
}

// Allow reports whether a fetch from host on behalf of namespace ("" for
// the operator) may use the agent's credentials.
func (a AgentCredentials) Allow(host, namespace string) bool {
	if namespace == "" {
		return true
	}
	nss := a.rules[credentialHost(host)]
	return slices.Contains(nss, AnyNamespace) || (namespace != UnknownNamespace && slices.Contains(nss, namespace))
}

// credentialHost is host as rules name it: lower case, Docker Hub as
// docker.io.
func credentialHost(host string) string {
	h := strings.ToLower(strings.TrimSpace(host))
	switch h {
	case "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com":
		return "docker.io"
	}
	return h
}

// namespaceRE is a Kubernetes namespace name (an RFC 1123 label).
var namespaceRE = regexp.MustCompile(`^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$`)

type requesterKey struct{}

// WithRequester marks ctx as a fetch on behalf of a pod of namespace ns;
// "" (and a context never marked) is the operator. Sources decide with it
// whether the agent's credentials go on the requests they make.
func WithRequester(ctx context.Context, ns string) context.Context {
	return context.WithValue(ctx, requesterKey{}, ns)
}

// Requester returns the namespace ctx's fetch is for; "" for the operator.
func Requester(ctx context.Context) string {
	ns, _ := ctx.Value(requesterKey{}).(string)
	return ns
}
