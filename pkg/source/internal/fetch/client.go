package fetch

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"

	"github.com/weightd/weightd/pkg/content"
)

// Client makes a source's HTTP requests: it names weightd in the User-Agent
// and keeps a URL's query (presigned URLs' credentials) out of its errors.
type Client struct {
	HTTP      *http.Client
	UserAgent string // "weightd/<version>"
}

// Do sends a request for u; header, if not nil, adds to its headers.
func (c Client) Do(ctx context.Context, method string, u *url.URL, header func(http.Header)) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, u.String(), nil)
	if err != nil {
		return nil, content.Permanent(fmt.Errorf("%s %s: %w", method, Redact(u), err))
	}
	req.Header.Set("User-Agent", c.UserAgent)
	if header != nil {
		header(req.Header)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		// url.Error repeats the URL, query and all.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("%s %s: %w", method, Redact(u), err)
	}
	return resp, nil
}
