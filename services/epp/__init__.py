"""The endpoint picker (epp): filters, weighted scorers and a picker choose an endpoint per request."""
